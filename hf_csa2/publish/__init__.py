"""Publishing converted and uplifted folders to the Hugging Face Hub (``hf-csa2 push`` / ``card``)."""

from .card import CardError, build_card, card_facts
from .push import PushOptions, push, write_card
from .validate import PublishError, check_folder

__all__ = ["CardError", "PublishError", "PushOptions", "build_card", "card_facts", "check_folder", "push",
           "write_card"]
