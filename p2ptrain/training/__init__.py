"""Training: state capture and transfer, checkpoints (the collaborative optimizer comes here too)."""

from . import checkpoint
from .model_state import capture, restore
from .state import StateError, decode, digest, encode, encoded_size

__all__ = ["StateError", "capture", "checkpoint", "decode", "digest", "encode", "encoded_size", "restore"]
