"""The training engine shared by every gradient-based step: the convert pipeline's distillation
stage, ``hf-csa2 distill`` and ``hf-csa2 train`` all run a transformers ``Trainer`` from here."""
