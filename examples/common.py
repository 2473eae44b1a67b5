"""What the integration examples share: a small GPT-2 and byte-level text, both made here (no
download), and the command-line options of a peer."""

from __future__ import annotations

import argparse
import hashlib

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from p2ptrain.tasks.text import load_corpus

BLOCK = 64


def options(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run", default="examples/swarm-run.toml", help="the swarm's run file")
    parser.add_argument("--listen", default="0.0.0.0:31337", help="HOST:PORT this peer listens on")
    parser.add_argument("--join", action="append", default=[], help="address of a peer in the swarm")
    parser.add_argument("--max-steps", type=int, default=200, help="local optimizer steps to take")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--wait-peers", type=int, default=1, help="peers to wait for before training")
    return parser.parse_args()


def small_gpt2(seed: int) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 over bytes (vocabulary 256), initialised from ``seed``: every peer builds the
    same one (a peer that joins late downloads the swarm's state anyway)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


class ByteWindows(torch.utils.data.Dataset):
    """Windows of ``BLOCK`` bytes of the Python standard library's sources, as language-model rows."""

    def __init__(self, max_bytes: int = 400_000) -> None:
        self.data = load_corpus(max_bytes, 0.05, 20_000).train.long()

    def __len__(self) -> int:
        return (len(self.data) - 1) // BLOCK

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.data[i * BLOCK : (i + 1) * BLOCK]
        return {"input_ids": row, "labels": row}


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
