"""The built-in GPT split into pipeline stages.

Theory of operation: :func:`split_gpt` cuts a :class:`~p2ptrain.tasks.gpt.GPT` by block. Stage 0 holds
the token and position embeddings and its blocks and maps token ids (B, T) to the residual stream
(B, T, C); a middle stage maps (B, T, C) to (B, T, C); the last stage holds its blocks, the final
LayerNorm and the language-model head and maps (B, T, C) to logits (B, T, vocab). Every peer builds
the whole model from the run's seed (as a data-parallel peer does) and keeps its own stage, so every
peer of a stage starts from the same bits; building it whole costs memory once, at start. (A model too
large for one host would be built stage by stage from the same generator: not needed at the sizes the
tests and benchmarks use.)

GPT-2 ties its head to the token embedding, which stage 0 and the last stage would then share across
two peers. The split gives each end a copy: the last stage's head starts as a *copy* of the embedding,
so the stages' parameters are disjoint. Stage 0's embedding gradient plus the last stage's head
gradient is exactly the tied model's embedding gradient (the tests check it), and a pipeline keeps the
copies one tensor by applying that sum to both every step (``stagewise.tie_ends``; :func:`tied_index`
says which of a stage's parameters is its copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tasks.gpt import GPT, GPTConfig
from .settings import PipelineSection


class Stage(nn.Module):
    """One stage of a split GPT: ``forward(x)`` maps the stage's input to its output (see the module
    docstring for the shapes), ``loss(logits, targets)`` is the task's loss on the last stage."""

    def __init__(self, index: int, count: int, config: GPTConfig, first: int, end: int) -> None:
        super().__init__()
        self.index, self.count, self.config = index, count, config
        self.first_layer, self.end_layer = first, end
        self.wte: nn.Embedding | None = None
        self.wpe: nn.Embedding | None = None
        self.ln_f: nn.LayerNorm | None = None
        self.lm_head: nn.Linear | None = None
        self.blocks = nn.ModuleList()

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            assert self.wte is not None and self.wpe is not None
            pos = torch.arange(x.shape[-1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            assert self.ln_f is not None and self.lm_head is not None
            x = self.lm_head(self.ln_f(x))
        return x

    def output_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        """The shape this stage returns for a micro-batch of ``batch`` sequences of ``seq`` tokens."""
        width = self.config.vocab_size if self.is_last else self.config.n_embd
        return (batch, seq, width)

    def input_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        return (batch, seq) if self.is_first else (batch, seq, self.config.n_embd)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def tied_index(stage: Stage) -> int | None:
    """The position, among ``stage``'s parameters, of its copy of the tied embedding (stage 0: the token
    embedding, the last stage: the head), None for a middle stage."""
    tied = stage.wte if stage.is_first else stage.lm_head if stage.is_last else None
    if tied is None:
        return None
    params = [p for p in stage.parameters() if p.requires_grad]
    return next(i for i, p in enumerate(params) if p is tied.weight)


def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The built-in task's loss: mean cross-entropy over every token of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def split_gpt(model: GPT, pipeline: PipelineSection) -> list[Stage]:
    """``model`` cut into the stages ``pipeline`` asks for; the stages take ``model``'s modules (no
    copy), except the last stage's head, a copy of the tied embedding. ``model`` must not be used after."""
    config = model.config
    if config.dropout:
        # a duplicated micro-batch must give the same output on two peers of a stage (see docs)
        raise ValueError(f"a pipeline needs dropout = 0, not {config.dropout}")
    bounds = pipeline.bounds(config.n_layer)
    stages = []
    for i, (first, end) in enumerate(bounds):
        stage = Stage(i, len(bounds), config, first, end)
        if i == 0:
            stage.wte, stage.wpe = model.wte, model.wpe
        stage.blocks = nn.ModuleList(model.blocks[first:end])
        if i == len(bounds) - 1:
            stage.ln_f = model.ln_f
            head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            with torch.no_grad():
                head.weight.copy_(model.wte.weight)  # untied: its own tensor, same initial values
            stage.lm_head = head
        stages.append(stage)
    return stages


def build_stage(config: GPTConfig, pipeline: PipelineSection, index: int, seed: int) -> Stage:
    """Stage ``index`` of the run's model, from the run's seed: the same bits on every peer."""
    if not 0 <= index < pipeline.num_stages:
        raise ValueError(f"stage {index} does not exist: the pipeline has {pipeline.num_stages}")
    torch.manual_seed(seed)
    return split_gpt(GPT(config), pipeline)[index]
