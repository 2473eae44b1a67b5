"""A small GPT: the model of the built-in task.

Theory of operation: a standard decoder-only transformer in the GPT-2 layout. Token embedding plus a
learned position embedding, ``n_layer`` pre-LayerNorm blocks (causal self-attention, then a 4x MLP with
GELU, each added to the residual stream), a final LayerNorm, and a language-model head whose weight is
the token embedding's (tied, as in GPT-2: fewer parameters to average, and a better model at this size).

Every peer must start from bit-identical weights. The caller seeds torch (``torch.manual_seed``) before
building the model; the constructor then draws every initial value from torch's default generator in a
fixed order (:meth:`GPT.initial_values`, in ``named_modules`` order), so the same seed gives the same
weights on every machine. Its linear layers and embeddings are created uninitialized (``_Linear``,
``_Embedding``): torch's own default initialization would fill every matrix once only for
``initial_values`` to fill it again, drawing random numbers for nothing and making a model of hundreds of
millions of parameters take half again as long to build. Storage is allocated once, where it stays.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True``,
which picks the fastest kernel the device has (flash or memory-efficient attention on GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`. ``vocab_size`` is 256 for byte-level text."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout!r}")

    def num_parameters(self) -> int:
        """The parameter count of a :class:`GPT` of this shape, without building one (no RNG drawn)."""
        c = self.n_embd
        # Per block: two LayerNorms (2C each), qkv (3C^2 + 3C), attn proj (C^2 + C), fc (4C^2 + 4C),
        # mlp proj (4C^2 + C). The LM head is tied to the token embedding, so it adds nothing.
        per_block = 12 * c * c + 13 * c
        return self.vocab_size * c + self.block_size * c + self.n_layer * per_block + 2 * c


class _Linear(nn.Linear):
    """``nn.Linear`` whose weight and bias are left uninitialized: :meth:`GPT.initial_values` fills them."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """``nn.Embedding`` whose weight is left uninitialized: :meth:`GPT.initial_values` fills it."""

    def reset_parameters(self) -> None:
        pass


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = _Linear(config.n_embd, 3 * config.n_embd)
        self.proj = _Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, T, 3C) -> three (B, n_head, T, head_dim) tensors.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        out: torch.Tensor = self.resid_dropout(self.proj(y))
        return out


class MLP(nn.Module):
    """The position-wise feed-forward layer: expand 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = _Linear(config.n_embd, 4 * config.n_embd)
        self.proj = _Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """A causal language model: ``forward(idx)`` maps (B, T) token ids to (B, T, vocab) logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = _Embedding(config.vocab_size, config.n_embd)
        self.wpe = _Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = _Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted and averaged once
        self._init_weights()

    def _init_weights(self) -> None:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, fill in self.initial_values():
                fill(params[name])

    def initial_values(self) -> Iterator[tuple[str, Callable[[torch.Tensor], object]]]:
        """The initialization, tensor by tensor, in the order it draws from torch's default generator:
        (parameter name, fill). The constructor applies it to its own parameters; a site that builds
        the model on the meta device applies it to one full tensor at a time and keeps its shard's rows
        (``Task.initial_values``): the same values, and no rank ever holds the whole model.

        GPT-2's initialization: N(0, 0.02) everywhere, with the projections that write into the residual
        stream (each block's attn.proj and mlp.proj) scaled down by 1/sqrt(2 * n_layer), so the stream's
        variance does not grow with depth; LayerNorms start as the identity. The tied lm_head is the
        embedding: skipped. Every other tensor is named here, in ``named_modules`` order: the
        constructor left the matrices uninitialized and drew nothing."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)

        def normal(std: float) -> Callable[[torch.Tensor], object]:
            return lambda t: nn.init.normal_(t, mean=0.0, std=std)

        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and module is not self.lm_head:
                yield f"{name}.weight", normal(residual_std if name.endswith(".proj") else 0.02)
                if module.bias is not None:
                    yield f"{name}.bias", nn.init.zeros_
            elif isinstance(module, nn.Embedding):
                yield f"{name}.weight", normal(0.02)
            elif isinstance(module, nn.LayerNorm):
                yield f"{name}.weight", nn.init.ones_
                yield f"{name}.bias", nn.init.zeros_

    def num_parameters(self) -> int:
        """The number of distinct parameter values (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits
