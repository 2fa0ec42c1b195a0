"""Measurements of a model that every layer above needs: KV-cache accounting (config and live
cache) and perplexity maths."""
