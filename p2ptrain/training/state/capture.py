"""Capture a model, its optimizers and extra tensors as named tensors and metadata; restore them.

:func:`capture` snapshots a model, its optimizers and extra tensors into names and metadata:

- ``model.<name>``: every ``model.state_dict()`` entry;
- ``optim.<key>.<index>.<state>``: each tensor in an optimizer's per-parameter state (``index`` is the
  parameter's position in the optimizer's groups, as in ``Optimizer.state_dict()``);
- ``metadata["optim.<key>"]``: JSON with the group sizes, the group hyperparameters and any non-tensor
  per-parameter state;
- ``extra.<name>``: the caller's extra tensors (for example DiLoCo's global copy of the parameters).

:func:`restore` validates the whole state against the local model and optimizers before touching either
(rule 4 in spirit: nothing is half applied), then loads it. Model entries must match by name, shape and
dtype. Optimizer group hyperparameters must have the local types and sane ranges; those that describe
the local implementation (``foreach``, ``fused``, ...) stay local. Per-parameter state tensors must
have the shape and dtype of their parameter (or of the local state they replace), be finite and, for
second moments, non-negative; Adam's state must be complete.

The result travels and rests in the byte format of :mod:`.codec` (encode, strict decode, digest).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from ...errors import LocalProtocolError
from .codec import FORMAT_KEY, FORMAT_VERSION, TIED_KEY, StateError, check_name, dtype_name, parse_json

_EMPTY: Mapping[str, Any] = MappingProxyType({})

# ---- capture -------------------------------------------------------------------------------------

_OPTIM_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")
_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")  # canonical: "01" and "1" must not both name parameter 1


def _snapshot(tensor: torch.Tensor, name: str, copy: bool = True) -> torch.Tensor:
    dtype_name(tensor, name)
    t = tensor.detach()
    if not copy:
        return t if t.is_contiguous() else t.contiguous()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu").contiguous()


def _plain(value: object, where: str, *, nested: bool = False) -> object:
    """A JSON-safe copy of a hyperparameter or non-tensor state value (tuples become lists)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LocalProtocolError(f"{where} is {value}; only finite numbers can be captured")
        return value
    if isinstance(value, list | tuple) and not nested:
        return [_plain(v, where, nested=True) for v in value]
    raise LocalProtocolError(f"{where} is a {type(value).__name__}; only plain numbers, strings and lists")


def _capture_optimizer(
    key: str, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], copy: bool
) -> str:
    """Add an optimizer's state tensors to ``tensors``; return the JSON for its other parts."""
    if not _OPTIM_KEY.fullmatch(key):
        raise LocalProtocolError(f"optimizer key {key!r} must be 1-64 letters, digits, '_' or '-'")
    sd = opt.state_dict()
    groups = []
    for gi, group in enumerate(sd["param_groups"]):
        hyper = {
            k: _plain(v, f"optimizer {key!r} group {gi} {k!r}") for k, v in group.items() if k != "params"
        }
        groups.append({"size": len(group["params"]), "hyper": hyper})
    scalars: dict[str, dict[str, object]] = {}
    for index, state in sd["state"].items():
        for skey, value in state.items():
            where = f"optimizer {key!r} parameter #{index} state {skey!r}"
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{key}.{index}.{skey}"] = _snapshot(value, where, copy)
            elif isinstance(value, str):  # torch's load_state_dict would mangle it (it iterates strings)
                raise LocalProtocolError(f"{where} is a string, which optimizers cannot reload")
            else:
                scalars.setdefault(str(index), {})[skey] = _plain(value, where, nested=True)
    doc = {"groups": groups, "state": scalars}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True, allow_nan=False)


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride())


def capture(
    model: torch.nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer] = _EMPTY,
    *,
    extra: Mapping[str, torch.Tensor] = _EMPTY,
    values: Mapping[str, torch.Tensor] = _EMPTY,
    copy: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Snapshot the model, optimizers and extra tensors: detached contiguous CPU clones, plus metadata.

    A model entry that is the very tensor of an earlier one (tied weights: GPT-2's token embedding and
    LM head) is stored once: ``metadata[TIED_KEY]`` maps its name to the one it shares. ``values``
    replaces model entries by name (DiLoCo's global parameters). With ``copy=False`` the result holds
    the live tensors themselves (on their devices), for a caller that reads them before they change.
    Raises :class:`LocalProtocolError` for state the format cannot carry (non-tensor model state, tensor
    hyperparameters, unsupported dtypes, bad names).
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[object, ...], str] = {}
    tied: dict[str, str] = {}
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise LocalProtocolError(f"model state {name!r} is a {type(value).__name__}, not a tensor")
        storage = _storage_key(value)
        if value.numel() and storage in seen:
            tied[name] = seen[storage]
            continue
        seen.setdefault(storage, name)
        tensors[f"model.{name}"] = _snapshot(values.get(name, value), name, copy)
    metadata = {FORMAT_KEY: FORMAT_VERSION}
    if tied:
        metadata[TIED_KEY] = json.dumps(tied, separators=(",", ":"), sort_keys=True)
    for key, opt in optimizers.items():
        metadata[f"optim.{key}"] = _capture_optimizer(key, opt, tensors, copy)
    for name, value in extra.items():
        tensors[f"extra.{name}"] = _snapshot(value, name, copy)
    for name in tensors:
        check_name(name, LocalProtocolError)
    return tensors, metadata


# ---- restore: validation ---------------------------------------------------------------------------

# Group entries that describe this machine's implementation (CUDA kernels, autograd through the step),
# not the training trajectory: a donor on a GPU must not switch a CPU joiner to fused kernels.
_LOCAL_ONLY = frozenset(("foreach", "fused", "capturable", "differentiable", "param_names", "params"))
_NON_NEGATIVE = frozenset(("lr", "initial_lr", "eps", "weight_decay", "momentum", "dampening"))
_SECOND_MOMENTS = frozenset(("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"))
_MAX_KEY = 64
_MAX_STR = 256


def _desc(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


def _more(names: Sequence[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _untie(
    local: Mapping[str, torch.Tensor], part: Mapping[str, torch.Tensor], raw: str | None
) -> dict[str, torch.Tensor]:
    """``part`` with the entries a state stores once (tied weights) filled in from the ones they share;
    only where the local model ties them too."""
    out = dict(part)
    if raw is None:
        return out
    tied = parse_json(raw.encode("utf-8", "surrogatepass"), "tied-weights metadata")
    if not isinstance(tied, dict) or len(tied) > len(local):
        raise StateError("tied-weights metadata must map model entries to model entries")
    for alias, target in tied.items():
        ref, src = local.get(alias), local.get(target) if isinstance(target, str) else None
        if ref is None or src is None or target not in part or alias in part:
            raise StateError(f"state ties {alias!r} to {target!r}, which the local model cannot take")
        if _storage_key(ref) != _storage_key(src):
            raise StateError(f"state ties {alias!r} to {target!r}; the local model keeps them apart")
        out[alias] = part[target]
    return out


def _check_model(
    model: torch.nn.Module, part: Mapping[str, torch.Tensor], tied: str | None = None
) -> dict[str, torch.Tensor]:
    local = model.state_dict()
    part = _untie(local, part, tied)
    missing = [n for n in local if n not in part]
    if missing:
        raise StateError(f"state lacks model entry {missing[0]!r}{_more(missing)}")
    unexpected = sorted(set(part) - set(local))
    if unexpected:
        raise StateError(
            f"state has model entry {unexpected[0]!r}{_more(unexpected)}, unknown to the local model"
        )
    for name, ref in local.items():
        if not isinstance(ref, torch.Tensor):
            raise LocalProtocolError(f"model state {name!r} is a {type(ref).__name__}, not a tensor")
        if part[name].shape != ref.shape or part[name].dtype != ref.dtype:
            raise StateError(f"model entry {name!r} is {_desc(part[name])}, the local model has {_desc(ref)}")
    # Not moved to the model's device here: load_state_dict's copy_ moves each tensor straight into its
    # parameter, without a second full copy of the model on the accelerator.
    return {name: part[name] for name in local}


def _like(value: object, ref: object, what: str) -> object:
    """``value`` if it is of the kind of ``ref``, the local value it replaces (tuples stay tuples)."""
    kind = type(value) if ref is None else type(ref)  # None locally (unset): any scalar may replace it
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int or kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is str:
        ok = isinstance(value, str) and len(value) <= _MAX_STR
    elif ref is None:
        ok = value is None
    elif isinstance(ref, tuple | list):
        if not isinstance(value, list) or len(value) != len(ref):
            raise StateError(f"{what} is {value!r}, expected a list of {len(ref)}")
        items = [_like(v, r, f"{what}[{i}]") for i, (v, r) in enumerate(zip(value, ref, strict=True))]
        return tuple(items) if isinstance(ref, tuple) else items  # Adam unpacks betas; keep torch's tuple
    else:
        raise LocalProtocolError(f"local {what} is a {type(ref).__name__}, which restore cannot replace")
    if not ok:
        raise StateError(f"{what} is {value!r}, which does not match the local {ref!r}")
    return value


def _check_hyper(where: str, remote: object, local: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(remote, dict):
        raise StateError(f"{where}: hyperparameters must be an object")
    out: dict[str, Any] = {}
    for name, ref in local.items():
        if name in _LOCAL_ONLY:
            out[name] = ref
        elif name not in remote:
            raise StateError(f"{where} lacks hyperparameter {name!r}")
        else:
            out[name] = _like(remote[name], ref, f"{where} {name!r}")
    for name, value in remote.items():
        if name in out or name in _LOCAL_ONLY:
            continue
        # Entries the local optimizer lacks (a scheduler's initial_lr): plain scalars only.
        if len(name) > _MAX_KEY or not (value is None or isinstance(value, bool | int | float)):
            raise StateError(f"{where} has an unexpected hyperparameter {name[:_MAX_KEY]!r}: {value!r}")
        out[name] = value
    for name in _NON_NEGATIVE & out.keys():
        if isinstance(out[name], int | float) and out[name] < 0:
            raise StateError(f"{where} {name!r} is {out[name]}, must not be negative")
    betas = out.get("betas")
    if isinstance(betas, tuple | list) and not all(isinstance(b, int | float) and 0 <= b < 1 for b in betas):
        raise StateError(f"{where} betas {betas} must lie in [0, 1)")
    return out


def _state_rules(
    opt: torch.optim.Optimizer, group: Mapping[str, Any]
) -> tuple[frozenset[str], frozenset[str] | None, frozenset[str]]:
    """(keys a non-empty state must hold, keys it may hold or None for any, keys shaped like the param)."""
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        moments = {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
        keys = frozenset(moments | {"step"})
        return keys, keys, frozenset(moments)
    if isinstance(opt, torch.optim.SGD):
        return frozenset(), frozenset({"momentum_buffer"}), frozenset({"momentum_buffer"})
    return frozenset(), None, frozenset()


def _check_state_tensor(
    what: str, key: str, value: torch.Tensor, param: torch.Tensor, local: object, shaped: bool
) -> None:
    if isinstance(local, torch.Tensor) and (value.shape != local.shape or value.dtype != local.dtype):
        raise StateError(f"{what} is {_desc(value)}, the local state has {_desc(local)}")
    if key == "step":
        if value.dim() != 0 or value.dtype == torch.bool:
            raise StateError(f"{what} is {_desc(value)}, expected a single number")
        step = float(value.double())
        if not (math.isfinite(step) and step >= 0):
            raise StateError(f"{what} is {step}, expected a finite count >= 0")
        return
    if shaped or (local is None and value.dim() > 0):
        if value.shape != param.shape:
            raise StateError(f"{what} has shape {list(value.shape)}, its parameter {list(param.shape)}")
        if param.is_floating_point() and value.dtype != param.dtype:
            raise StateError(f"{what} is {value.dtype}, its parameter {param.dtype}")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise StateError(f"{what} holds NaN or infinite values")
    if key in _SECOND_MOMENTS and bool((value < 0).any()):
        raise StateError(f"{what} holds negative values (a second moment)")


def _check_param_state(
    where: str,
    param: torch.Tensor,
    entry: Mapping[str, object],
    local: Mapping[str, object],
    rules: tuple[frozenset[str], frozenset[str] | None, frozenset[str]],
) -> None:
    required, allowed, shaped = rules
    if entry and not required <= entry.keys():
        raise StateError(f"{where} lacks state {sorted(required - entry.keys())[0]!r}")
    if allowed is not None and not entry.keys() <= allowed:
        raise StateError(f"{where} has unexpected state {sorted(entry.keys() - allowed)[0]!r}")
    for key, value in entry.items():
        what = f"{where} state {key!r}"
        if isinstance(value, torch.Tensor):
            _check_state_tensor(what, key, value, param, local.get(key), key in shaped)
        elif value is None and key == "momentum_buffer":
            pass  # SGD treats a None buffer as absent and starts a new one
        elif isinstance(local.get(key), torch.Tensor) or key in shaped:
            raise StateError(f"{what} is {value!r}, expected a tensor")
        elif key == "step" and not (
            isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
        ):
            raise StateError(f"{what} is {value!r}, expected a count >= 0")
        elif not (value is None or isinstance(value, bool | int | float)):
            raise StateError(f"{what} is {value!r}, expected a number")


def _merge_state(
    where: str, scalars: object, tensors: Mapping[int, Mapping[str, torch.Tensor]]
) -> dict[int, dict[str, object]]:
    if not isinstance(scalars, dict):
        raise StateError(f"{where}: per-parameter state must be an object")
    merged: dict[int, dict[str, object]] = {i: dict(t) for i, t in tensors.items()}
    for index, entry in scalars.items():
        if not _INDEX.fullmatch(index) or not isinstance(entry, dict):
            raise StateError(f"{where}: per-parameter state {index[:20]!r} is not an index with an object")
        slot = merged.setdefault(int(index), {})
        for key, value in entry.items():
            if key in slot or len(key) > _MAX_KEY:
                raise StateError(f"{where} parameter #{index}: state {key[:_MAX_KEY]!r} repeated or too long")
            slot[key] = value
    return merged


def _check_optimizer(
    key: str,
    opt: torch.optim.Optimizer,
    doc: object,
    tensors: Mapping[int, Mapping[str, torch.Tensor]],
    owned: bool = False,
    tensors_only: bool = False,
) -> dict[str, Any]:
    """Validate one optimizer's part of a state; return the state dict to load into it."""
    where = f"optimizer {key!r}"
    if not isinstance(doc, dict) or set(doc) != {"groups", "state"}:
        raise StateError(f"{where}: metadata must be an object with groups and state")
    groups = doc["groups"]
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        count = len(groups) if isinstance(groups, list) else "no"
        raise StateError(f"{where} has {count} parameter groups, the local one {len(opt.param_groups)}")
    new_groups: list[dict[str, Any]] = []
    params: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for gi, (remote, local) in enumerate(zip(groups, opt.param_groups, strict=True)):
        size = len(local["params"])
        if not isinstance(remote, dict) or set(remote) != {"size", "hyper"} or remote["size"] != size:
            got = remote.get("size") if isinstance(remote, dict) else remote
            raise StateError(f"{where} group {gi} has {got!r} parameters, the local one {size}")
        hyper = _check_hyper(f"{where} group {gi}", remote["hyper"], local)
        if tensors_only:  # the run's settings, not the sender's word
            hyper = {k: v for k, v in local.items() if k != "params"}
        hyper["params"] = list(range(len(params), len(params) + size))  # Optimizer.state_dict() numbering
        new_groups.append(hyper)
        params.extend((p, hyper) for p in local["params"])
    if tensors_only and doc["state"]:
        raise StateError(f"{where} carries non-tensor state, which a state's digest does not cover")
    state = _merge_state(where, doc["state"], tensors)
    for index, entry in state.items():
        if index >= len(params):
            raise StateError(f"{where} has state for parameter #{index}, but only {len(params)} parameters")
        param, group = params[index]
        local_state = opt.state.get(param, {})  # .get: the state is a defaultdict; do not grow it
        _check_param_state(f"{where} parameter #{index}", param, entry, local_state, _state_rules(opt, group))
    # Cloned: torch's load_state_dict keeps tensors that already have the parameter's device and dtype,
    # and the optimizer must not share memory with tensors the caller still holds.
    loaded = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) and not owned else v for k, v in e.items()}
        for i, e in state.items()
    }
    return {"state": {i: e for i, e in sorted(loaded.items()) if e}, "param_groups": new_groups}


def _check_extras(
    part: Mapping[str, torch.Tensor], wanted: Sequence[str] | Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    missing = [n for n in wanted if n not in part]
    if missing:
        raise StateError(f"state lacks extra tensor {missing[0]!r}{_more(missing)}")
    unexpected = sorted(set(part) - set(wanted))
    if unexpected:
        raise StateError(f"state has unexpected extra tensor {unexpected[0]!r}{_more(unexpected)}")
    if isinstance(wanted, Mapping):
        for name, ref in wanted.items():
            if part[name].shape != ref.shape or part[name].dtype != ref.dtype:
                raise StateError(f"extra tensor {name!r} is {_desc(part[name])}, expected {_desc(ref)}")
    return {name: part[name] for name in wanted}


def _split(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    extra: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        section, _, rest = name.partition(".")
        if section == "model" and rest:
            model[rest] = tensor
        elif section == "extra" and rest:
            extra[rest] = tensor
        elif section == "optim":
            parts = rest.split(".", 2)
            if len(parts) != 3 or not _OPTIM_KEY.fullmatch(parts[0]) or not _INDEX.fullmatch(parts[1]):
                raise StateError(f"tensor {name!r} is not optim.<key>.<parameter index>.<state>")
            optim.setdefault(parts[0], {}).setdefault(int(parts[1]), {})[parts[2]] = tensor
        else:
            raise StateError(f"tensor {name!r} is not under model., optim. or extra.")
    return model, optim, extra


# ---- restore ---------------------------------------------------------------------------------------


def restore(
    model: torch.nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    extra_names: Sequence[str] | Mapping[str, torch.Tensor] = (),
    owned: bool = False,
    tensors_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Validate a captured state against the local model and optimizers, then load it; return the extras.

    ``extra_names`` lists the extra tensors the state must hold (no more, no fewer), returned under
    those names; pass a mapping of name -> template tensor to also require each one's shape and dtype.
    Any mismatch raises :class:`StateError` naming the offending entry before the model or any
    optimizer is modified. Hyperparameters come from the state (learning rate, betas, ...), except
    those that describe this machine's implementation (foreach, fused, capturable, differentiable).
    ``owned``: the caller hands the tensors over (a fresh download), so optimizer state is loaded
    without a copy. ``tensors_only``: take from the state only what its digest covers, the tensors
    (a download, checked against a digest): the hyperparameters stay the local optimizer's (the run's
    settings), and non-tensor per-parameter state is refused.
    """
    if metadata.get(FORMAT_KEY) != FORMAT_VERSION:
        raise StateError(f"state format is {metadata.get(FORMAT_KEY)!r}, expected {FORMAT_VERSION!r}")
    model_part, optim_parts, extra_part = _split(tensors)
    unknown = sorted(set(optim_parts) - set(optimizers))
    unknown += sorted(k[6:] for k in metadata if k.startswith("optim.") and k[6:] not in optimizers)
    if unknown:
        raise StateError(f"state holds optimizer {unknown[0]!r}, which this node does not have")
    model_sd = _check_model(model, model_part, metadata.get(TIED_KEY))
    optim_sds = {}
    for key, opt in optimizers.items():
        raw = metadata.get(f"optim.{key}")
        if raw is None:
            raise StateError(f"state lacks optimizer {key!r}")
        doc = parse_json(raw.encode("utf-8", "surrogatepass"), f"optimizer {key!r} metadata")
        optim_sds[key] = _check_optimizer(key, opt, doc, optim_parts.get(key, {}), owned, tensors_only)
    extras = _check_extras(extra_part, extra_names)
    # Everything is validated: from here on nothing is expected to raise, so nothing is half applied.
    model.load_state_dict(model_sd, strict=True)
    for key, opt in optimizers.items():
        opt.load_state_dict(optim_sds[key])
    return extras
