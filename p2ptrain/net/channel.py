"""Length-prefixed frames over a trio stream, and the encrypted record channel on top of them.

Theory of operation: every frame on the socket is a 4-byte big-endian length followed by that many
bytes. The length is checked against a hard maximum *before* anything is allocated, so a peer that
announces a 4 GiB frame is cut off after 4 bytes.

After the handshake each frame is one AEAD ciphertext (AEGIS-256, 32-byte tag). The nonce is a counter
per direction, never sent: the receiver expects counter n for its n-th frame, so a replayed, dropped or
reordered frame fails authentication and the channel is closed. Inside, a *record* is a msgpack header
(small, validated by the RPC layer) and a raw body (bulk bytes, never msgpack-encoded)::

    plaintext = u32 header length | header | body
"""

from __future__ import annotations

import struct

import nacl.bindings as sodium
import nacl.exceptions
import trio

from ..errors import ConnectionClosed, LocalProtocolError, RemoteProtocolError
from ..wire.codec import MAX_HEADER_BYTES
from .handshake import HandshakeResult

LENGTH = struct.Struct(">I")
TAG_BYTES = 32
MAX_CHUNK = 1 << 20
"""Largest body in one record; bigger payloads are streamed in chunks of at most this size."""
MAX_FRAME = MAX_CHUNK + MAX_HEADER_BYTES + LENGTH.size + TAG_BYTES
_RECV_SIZE = 256 * 1024
_MAX_COUNTER = 2**64 - 1


class FramedStream:
    """Length-prefixed frames over a byte stream, with a hard frame size limit."""

    def __init__(self, stream: trio.abc.Stream, max_frame: int = MAX_FRAME) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self._buf = bytearray()
        self.bytes_sent = 0
        self.bytes_received = 0

    async def send_frame(self, *parts: bytes | memoryview) -> None:
        n = sum(len(p) for p in parts)
        if n > self.max_frame:
            raise LocalProtocolError(f"frame of {n} bytes exceeds the {self.max_frame}-byte limit")
        try:
            if n < 64 * 1024:
                await self.stream.send_all(b"".join([LENGTH.pack(n), *parts]))
            else:
                await self.stream.send_all(LENGTH.pack(n))
                for p in parts:
                    await self.stream.send_all(p)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionClosed(f"connection lost while sending: {e}") from None
        self.bytes_sent += n + LENGTH.size

    async def _fill(self, need: int) -> None:
        while len(self._buf) < need:
            try:
                data = await self.stream.receive_some(max(need - len(self._buf), _RECV_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise ConnectionClosed(f"connection lost while receiving: {e}") from None
            if not data:
                if self._buf:
                    raise RemoteProtocolError("connection closed in the middle of a frame")
                raise ConnectionClosed("connection closed by the remote")
            self._buf += data
            self.bytes_received += len(data)

    async def receive_frame(self) -> bytes:
        await self._fill(LENGTH.size)
        (n,) = LENGTH.unpack_from(self._buf)
        if n > self.max_frame:
            raise RemoteProtocolError(
                f"frame length {n} exceeds the {self.max_frame}-byte limit; refusing before reading it"
            )
        await self._fill(LENGTH.size + n)
        frame = bytes(memoryview(self._buf)[LENGTH.size : LENGTH.size + n])
        del self._buf[: LENGTH.size + n]
        return frame


class FrameCipher:
    """AEAD with a counter nonce for one direction of a channel (pure, no I/O)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("key must be 32 bytes")
        self._key = key
        self._counter = 0

    def _next_nonce(self) -> bytes:
        if self._counter >= _MAX_COUNTER:
            raise LocalProtocolError("nonce counter exhausted; the connection must be re-established")
        nonce = self._counter.to_bytes(8, "little") + bytes(24)
        self._counter += 1
        return nonce

    def seal(self, plaintext: bytes) -> bytes:
        return sodium.crypto_aead_aegis256_encrypt(plaintext, None, self._next_nonce(), self._key)

    def open(self, ciphertext: bytes) -> bytes:
        if len(ciphertext) < TAG_BYTES:
            raise RemoteProtocolError("frame is shorter than its authentication tag")
        try:
            return sodium.crypto_aead_aegis256_decrypt(ciphertext, None, self._next_nonce(), self._key)
        except nacl.exceptions.CryptoError:
            raise RemoteProtocolError(
                "frame failed authentication (tampered, replayed, reordered or truncated)"
            ) from None


def encode_record(header: bytes, body: bytes | memoryview = b"") -> bytes:
    if len(header) > MAX_HEADER_BYTES:
        raise LocalProtocolError("record header too large")
    if len(body) > MAX_CHUNK:
        raise LocalProtocolError(f"record body of {len(body)} bytes exceeds {MAX_CHUNK}")
    return b"".join((LENGTH.pack(len(header)), header, body))


def decode_record(plain: bytes) -> tuple[memoryview, memoryview]:
    """Split a decrypted record into (header, body) views."""
    if len(plain) < LENGTH.size:
        raise RemoteProtocolError("record too short")
    (hlen,) = LENGTH.unpack_from(plain)
    if hlen > MAX_HEADER_BYTES or LENGTH.size + hlen > len(plain):
        raise RemoteProtocolError("record header length out of bounds")
    view = memoryview(plain)
    return view[LENGTH.size : LENGTH.size + hlen], view[LENGTH.size + hlen :]


class SecureChannel:
    """Encrypted records over a framed stream. Sends are serialized; one reader at a time."""

    def __init__(self, framed: FramedStream, keys: HandshakeResult) -> None:
        self.framed = framed
        self._send_cipher = FrameCipher(keys.send_key)
        self._recv_cipher = FrameCipher(keys.recv_key)
        self._send_lock = trio.Lock()

    async def send(self, header: bytes, body: bytes | memoryview = b"") -> None:
        record = encode_record(header, body)
        async with self._send_lock:
            # Seal under the lock: the nonce order must equal the order on the wire.
            await self.framed.send_frame(self._send_cipher.seal(record))

    async def receive(self) -> tuple[memoryview, memoryview]:
        frame = await self.framed.receive_frame()
        return decode_record(self._recv_cipher.open(frame))

    async def aclose(self) -> None:
        await self.framed.stream.aclose()
