"""Training-side procedures (indexer warm-up; PEFT uplift recipes come later)."""
