"""The checkpoint and download format is safetensors: the reference package (``safetensors``) reads what
p2ptrain writes, and p2ptrain's strict decoder reads what the package writes. p2ptrain keeps its own
codec for what the package does not do: streaming a state out of file-backed tensors in pieces without
joining it, and decoding bytes from a possibly hostile donor with every bound checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.training.state import checkpoint, codec

safetensors_torch = pytest.importorskip("safetensors.torch")
safetensors = pytest.importorskip("safetensors")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(3, 5, generator=g),
        "model.b": torch.randn(7, generator=g).to(torch.bfloat16),
        "optim.0.0.step": torch.tensor(12.0),
        "extra.ids": torch.arange(4, dtype=torch.int64),
        "extra.empty": torch.zeros(0, 2),
    }


def test_a_checkpoint_reads_with_the_reference_package(tmp_path: Path) -> None:
    saved = checkpoint.save(tmp_path, 3, tensors(), {"optim.0": '{"groups": []}'}, {"epoch": 3})
    path = saved / checkpoint.STATE_FILE
    loaded = safetensors_torch.load_file(str(path))
    assert loaded.keys() == tensors().keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors().items())
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"optim.0": '{"groups": []}'}


def test_the_strict_decoder_reads_what_the_reference_package_writes() -> None:
    data = safetensors_torch.save(tensors(), metadata={"k": "v"})
    decoded, metadata = codec.decode(data)
    assert metadata == {"k": "v"}
    assert decoded.keys() == tensors().keys()
    assert all(torch.equal(decoded[k], v) and decoded[k].dtype == v.dtype for k, v in tensors().items())
