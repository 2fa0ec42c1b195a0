"""hf-csa2: attention surgery for Hugging Face causal LMs.

Importing the package registers the converted-model classes with transformers' Auto
classes, so converted checkpoints load natively (no ``trust_remote_code`` needed).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .model import Csa2Config, Csa2ForCausalLM

__version__ = "0.1.0"

AutoConfig.register(Csa2Config.model_type, Csa2Config, exist_ok=True)
AutoModelForCausalLM.register(Csa2Config, Csa2ForCausalLM, exist_ok=True)
# save_pretrained copies model/ next to the weights and writes auto_map, so a machine
# without hf_csa2 can load the checkpoint with trust_remote_code=True.
Csa2Config.register_for_auto_class()
Csa2ForCausalLM.register_for_auto_class("AutoModelForCausalLM")


from .surgery.pipeline import convert  # noqa: E402  (after the registration above)


__all__ = ["Csa2Config", "Csa2ForCausalLM", "convert", "__version__"]
