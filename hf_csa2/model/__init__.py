"""Self-contained model package of hf-csa2 (copied next to converted weights on save)."""

from .configuration_hf_csa2 import SUPPORTED_BASE_MODEL_TYPES, Csa2Config
from .modeling_hf_csa2 import (
    SINK_OFF,
    DenseSinkAttention,
    AttentionBase,
    Csa2ForCausalLM,
    Csa2FullAttention,
    LatentAttention,
    Csa2PreTrainedModel,
    Csa2ReaderAttention,
)

__all__ = ["DenseSinkAttention", "AttentionBase", "Csa2FullAttention", "LatentAttention", "Csa2ReaderAttention", "Csa2Config", "Csa2ForCausalLM", "Csa2PreTrainedModel", "SINK_OFF", "SUPPORTED_BASE_MODEL_TYPES"]
