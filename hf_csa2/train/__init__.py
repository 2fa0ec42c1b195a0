"""Uplift: train a converted checkpoint back toward its source (``hf-csa2 train RECIPE.yaml``)."""
