"""Training-side procedures: indexer warm-up, end-to-end distillation toward the source, the held-out keep rule (PEFT uplift recipes come later)."""
