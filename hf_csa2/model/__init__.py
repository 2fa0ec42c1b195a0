"""Self-contained model package of hf-csa2 (copied next to converted weights on save)."""

from .configuration_hf_csa2 import SUPPORTED_BASE_MODEL_TYPES, Csa2Config
from .modeling_hf_csa2 import (
    SINK_OFF,
    Csa2Attention,
    Csa2AttentionBase,
    Csa2ForCausalLM,
    Csa2FullAttention,
    Csa2LatentAttention,
    Csa2PreTrainedModel,
    Csa2WindowAttention,
)

__all__ = ["Csa2Attention", "Csa2AttentionBase", "Csa2FullAttention", "Csa2LatentAttention", "Csa2WindowAttention", "Csa2Config", "Csa2ForCausalLM", "Csa2PreTrainedModel", "SINK_OFF", "SUPPORTED_BASE_MODEL_TYPES"]
