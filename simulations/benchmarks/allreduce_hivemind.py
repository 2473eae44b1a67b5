"""hivemind's all-reduce as a peer of the all-reduce benchmark: ``hivemind.averaging.DecentralizedAverager``.

Run by the interpreter that has hivemind (``--hivemind-python`` of ``simulations.benchmarks.allreduce``, whose
contract this follows). One ``hivemind.DHT`` (its own process and p2pd daemon) listening on ``--listen``
and bootstrapping from ``--join``, and one averager over one fp32 tensor with the settings of our
reference figures: ``target_group_size=N, min_group_size=N, min_matchmaking_time=2.0,
request_timeout=1.0, allreduce_timeout=600``; compression ``none`` (NoCompression), ``fp16``
(Float16Compression) or ``int8`` (Uniform8BitQuantization).

A round: the tensor is reset to this peer's pattern, then ``step(require_trigger=True, wait=False)``
matchmakes; once the group is formed (stage AWAITING_TRIGGER) the peer reports ``ready``; on "go" it
triggers the all-reduce and times it to ``step``'s result (``matchmaking_s`` is reported apart).

With int8 under numpy 2, hivemind's 8-bit decoding is patched (:func:`patch_int8_for_numpy2`); the
peer says so in its ``listening`` line (``notes``), and the report carries it.

``--dial-all``: once the harness lists every peer's address, each peer's daemon connects to every other
one by hand (``P2P._client.connect(peer_id, maddrs)`` in the DHT process). Without it, peers in separate
network namespaces got as far as forming a group, then the followers failed to reach each other
("routing: not found": their daemons had no address for a peer they had never talked to directly).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Any

from simulations.benchmarks.allreduce import (
    Commands,
    emit,
    exact_mean,
    numel_for,
    pattern,
    peer_parser,
    split_addr,
)

PREFIX = "bench_allreduce"
POLL_S = 0.005


async def dial_all(_dht: Any, node: Any, maddrs: list[str]) -> int:
    """In the DHT process: connect this daemon to each of ``maddrs`` (each ending in /p2p/<peer id>)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    for text in maddrs:
        maddr = Multiaddr(text)
        peer_id = PeerID.from_base58(maddr["p2p"])
        await node.p2p._client.connect(peer_id, [maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))])
    return len(maddrs)


def patch_int8_for_numpy2() -> str | None:
    """hivemind 1.1.12 decodes 8-bit tensors with ``int(np.frombuffer(..., count=1))``, which numpy 2 refuses
    (TypeError). The failure stays inside the averager: the step "succeeds" with parts left unaveraged
    (peers log "received 0.0% results"). Replace that one line, so that the design is what is measured."""
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int64))
    except TypeError:
        pass
    else:
        return None
    import torch
    from hivemind.compression.quantization import Quantization

    def extract(self: Any, serialized_tensor: Any) -> Any:  # hivemind's own, but for the [0]
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(
            serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype
        )
        quantized = np.frombuffer(
            serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype
        )
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    Quantization.extract = extract
    return f"patched hivemind's 8-bit decoding for numpy {np.__version__} (int() of a 1-element array)"


def compression_of(name: str) -> Any:
    from hivemind import compression

    table = {
        "none": compression.NoCompression,
        "fp16": compression.Float16Compression,
        "int8": compression.Uniform8BitQuantization,
    }
    if name not in table:
        raise ValueError(f"hivemind has no {name} compression for fp32 tensors")
    return table[name]()


def main(argv: list[str] | None = None) -> int:
    parser = peer_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dial-all", action="store_true", help="dial every other peer before the first round"
    )
    args = parser.parse_args(argv)
    commands = Commands()
    dht = averager = None
    try:
        import hivemind
        import torch

        numel = numel_for(args.mb)
        local = torch.from_numpy(pattern(args.index, numel))
        expected = torch.from_numpy(exact_mean(args.peers, numel))
        notes = [note] if args.compression == "int8" and (note := patch_int8_for_numpy2()) else []
        host, port = split_addr(args.listen)
        dht = hivemind.DHT(
            initial_peers=[args.join] if args.join else None,
            start=True,
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            # hivemind's defaults reach beyond this host (port mapping, AutoNAT, relays): all off.
            nat_port_map=False,
            auto_nat=False,
            use_relay=False,
            use_auto_relay=False,
            use_ipfs=False,
        )
        addr = next(str(m) for m in dht.get_visible_maddrs() if f"/ip4/{host}/" in str(m))
        averager = hivemind.averaging.DecentralizedAverager(
            [local.clone()],
            dht,
            start=True,
            prefix=PREFIX,
            target_group_size=args.peers,
            min_group_size=args.peers,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            allreduce_timeout=600.0,
            compression=compression_of(args.compression),
        )
        emit("listening", addr=addr, notes=notes)
        addrs = commands.wait("peers", args.timeout)["addrs"]
        if args.dial_all:
            others = [a for a in addrs if a != addr]
            dht.run_coroutine(partial(dial_all, maddrs=others), return_future=True).result(args.timeout)
        for r in range(args.rounds):
            run_round(args, r, averager, local, expected, commands)
        emit("done")
    except Exception as e:
        emit("error", error=f"{type(e).__name__}: {e}"[:2000])
        return 1
    finally:
        for part in (averager, dht):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as e:  # a failing shutdown must not hide the result; the harness kills us
                    print(f"shutdown: {e!r}", file=sys.stderr)
    return 0


def run_round(args: Any, r: int, averager: Any, local: Any, expected: Any, commands: Commands) -> None:
    from hivemind.averaging.control import AveragingStage

    with averager.get_tensors() as tensors:
        tensors[0].copy_(local)
    began = time.perf_counter()
    control = averager.step(require_trigger=True, wait=False, timeout=args.timeout)
    deadline = time.monotonic() + args.timeout
    while control.stage != AveragingStage.AWAITING_TRIGGER:
        if control.done():
            control.result()  # raises what failed
            raise RuntimeError("averaging step ended before the all-reduce")
        if time.monotonic() > deadline:
            control.cancel()
            raise TimeoutError(f"no group in {args.timeout:g} s")
        time.sleep(POLL_S)
    matchmaking_s = time.perf_counter() - began
    emit("ready", round=r, matchmaking_s=round(matchmaking_s, 3))
    commands.wait("go", args.timeout, round=r)
    began = time.perf_counter()
    control.allow_allreduce()
    if control.result(timeout=args.timeout) is None:
        raise RuntimeError("the all-reduce failed")
    seconds = time.perf_counter() - began
    emit("round", round=r, seconds=round(seconds, 6), wire_bytes=None, matchmaking_s=matchmaking_s)
    commands.wait("check", args.timeout, round=r)  # the others are done: checking costs no one
    with averager.get_tensors() as tensors:
        emit("checked", round=r, max_err=float((tensors[0] - expected).abs().max()))


if __name__ == "__main__":
    sys.exit(main())
