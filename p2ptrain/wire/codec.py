"""msgpack encoding with hard limits.

Headers are small msgpack arrays or maps; bulk bytes never travel inside them (they ride raw beside
the header). The unpacker is given limits on every container and string so that a hostile peer
cannot make us allocate more than a header's worth of memory, and extension types (which could
smuggle arbitrary objects) are refused outright.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..errors import RemoteProtocolError

MAX_HEADER_BYTES = 64 * 1024


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def pack_array(packed: list[bytes]) -> bytes:
    """A msgpack array of items already packed (``pack([a, b])`` equals ``pack_array([pack(a), pack(b)])``):
    what an item's sender packed once is not packed again for every reader it goes to."""
    return msgpack.Packer().pack_array_header(len(packed)) + b"".join(packed)  # type: ignore[no-any-return]


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack(data: bytes | memoryview, *, max_bytes: int = MAX_HEADER_BYTES) -> Any:
    """Decode one msgpack object, or raise RemoteProtocolError saying why not."""
    if len(data) > max_bytes:
        raise RemoteProtocolError(f"header of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_no_ext,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,  # (an element takes a byte at least: a small int, a bool, "")
            max_map_len=max_bytes // 2,  # (an entry, two)
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise RemoteProtocolError(f"malformed msgpack: {e}") from None
