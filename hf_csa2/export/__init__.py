"""Exports of converted checkpoints to stock transformers architectures."""
