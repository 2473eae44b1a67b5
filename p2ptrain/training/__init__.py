"""Training: state capture and transfer, checkpoints (the collaborative optimizer comes here too)."""

from . import checkpoint
from .state import StateError, capture, decode, digest, encode, encoded_size, restore

__all__ = ["StateError", "capture", "checkpoint", "decode", "digest", "encode", "encoded_size", "restore"]
