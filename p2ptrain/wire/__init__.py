"""The wire contract: msgpack codec with limits, validated message dataclasses, frame sizes."""

from .codec import MAX_HEADER_BYTES, pack, unpack
from .schema import Message, bounded, decode_message

__all__ = ["MAX_HEADER_BYTES", "Message", "bounded", "decode_message", "pack", "unpack"]
