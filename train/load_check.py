"""Did from_pretrained load what the checkpoint holds? Key coverage, logical shapes, and optionally values.

Checkpoint keys and shapes come from the safetensors headers (no tensor is read). Each key is mapped to a
model name with transformers' own rules (`get_model_conversion_mapping` + `rename_source_key`, the same
calls from_pretrained makes, including adding/removing the base-model prefix `model.`), so a renamed
layout such as `language_model.*` -> `model.language_model.*` is reported as a prefix mapping, not as a
missing key. Anything that stays unmatched either way is an error naming the key: a model must never
train on silently re-initialized weights.

Under ZeRO-3 a parameter's local shape is [0]; its logical shape is `ds_shape`. The value check gathers
parameters with `deepspeed.zero.GatheredParameters` in checkpoint-key order, the same on every rank (the
gather is a collective), and each rank compares its share of the keys.
"""
from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections import Counter
from pathlib import Path

import torch

from train.zero import gathered
SAFETENSORS_INDEX = "model.safetensors.index.json"
GATHER_NUMEL = 64 * 2**20  # gather at most this many elements at once during --verify-load


class LoadError(RuntimeError):
    """The loaded model does not match its checkpoint; the message names the keys."""


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "F32", "BF16"
    file: str  # file name inside the model directory


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def checkpoint_entries(model_dir: str | Path) -> dict[str, CheckpointEntry]:
    """Every tensor of a save_pretrained directory, from the safetensors headers."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints can be verified)")
    out: dict[str, CheckpointEntry] = {}
    for name in files:
        for key, meta in _header(model_dir / name).items():
            if key == "__metadata__":
                continue
            if key in out:
                raise LoadError(f"{model_dir}: key {key} appears in both {out[key].file} and {name}")
            out[key] = CheckpointEntry(key, tuple(meta["shape"]), meta["dtype"], name)
    return out


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The full shape of a parameter, also when ZeRO-3 has partitioned it away (local shape [0]) or
    bitsandbytes packed it into 4-bit storage (its quant_state keeps the original shape)."""
    quant_state = getattr(t, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return tuple(quant_state.shape)
    return tuple(getattr(t, "ds_shape", t.shape))


@dataclasses.dataclass
class LoadReport:
    entries: int  # tensors in the checkpoint
    mapping: dict[str, str]  # checkpoint key -> model state-dict name (1:1 renamings only)
    prefix_changes: dict[str, int]  # "language_model.* -> model.language_model.*": keys
    tied: dict[str, str]  # checkpoint key mapped to a tied (shared) weight -> the name holding it
    converted: list[str]  # keys transformers combines/splits (not 1:1): shape/value checks skipped
    ignored: dict[str, int]  # pattern from the model class's _keys_to_ignore_on_load_unexpected -> keys (e.g. ^mtp.*)
    partitioned: int  # parameters whose local shape is [0] (ZeRO-3)
    parameters: int  # model state-dict entries

    def message(self) -> str:
        lines = [f"load check: {self.entries} checkpoint entries -> {self.parameters} model tensors, all keys mapped, "
                 "logical shapes equal"]
        same = (self.entries - sum(self.prefix_changes.values()) - len(self.converted) - len(self.tied)
                - sum(self.ignored.values()))
        lines.append(f"  {same} keys map 1:1")
        for rule, n in sorted(self.prefix_changes.items()):
            lines.append(f"  {n} keys renamed by transformers' key mapping: {rule}")
        for k, v in self.tied.items():
            lines.append(f"  {k} is tied to {v} (not a separate parameter)")
        for pattern, n in sorted(self.ignored.items()):
            lines.append(f"  {n} keys not loaded on purpose (the model class ignores {pattern})")
        if self.converted:
            lines.append(f"  {len(self.converted)} keys converted (not 1:1) by transformers; shapes not compared")
        if self.partitioned:
            lines.append(f"  {self.partitioned} parameters are ZeRO-3 partitioned (local shape [0]; compared via ds_shape)")
        return "\n".join(lines)


def _prefix_rule(src: str, dst: str) -> str:
    """'language_model.layers.0.x' vs 'model.language_model.layers.0.x' -> '* -> model.*'-style summary."""
    a, b = src.split("."), dst.split(".")
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    # keep the first common part so the rule reads like a prefix (layer numbers differ per key otherwise)
    keep = 1 if n else 0
    ha = ".".join(a[: len(a) - n + keep])
    hb = ".".join(b[: len(b) - n + keep])
    return f"{ha or '<root>'}.* -> {hb or '<root>'}.*"


def map_checkpoint_keys(model, keys) -> tuple[dict[str, str], list[str]]:
    """checkpoint key -> model name via transformers' conversion mapping; second value: keys that a
    WeightConverter (many-to-one) consumes."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = {k: True for k in model.state_dict().keys()}
    mapping, converted = {}, []
    for key in keys:
        new, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if pattern is not None:
            converted.append(key)
        mapping[key] = new
    return mapping, converted


def check_load(model, model_dir: str | Path, loading_info: dict | None = None) -> tuple[LoadReport, dict[str, CheckpointEntry]]:
    """Every checkpoint key maps to a model tensor of the same logical shape, and every model tensor is
    covered (or tied). Raises LoadError listing every problem."""
    entries = checkpoint_entries(model_dir)
    mapping, converted = map_checkpoint_keys(model, entries)
    params = dict(model.named_parameters())
    tensors = {**dict(model.named_buffers()), **params}
    state_names = set(model.state_dict().keys())
    tied_targets = dict(getattr(model, "all_tied_weights_keys", None) or {})
    problems: list[str] = []

    if loading_info:
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            vals = loading_info.get(kind) or []
            if vals:
                problems.append(f"transformers reports {kind}: {', '.join(map(str, sorted(map(str, vals))[:20]))}")

    ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    ignore_missing = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    ignored: Counter[str] = Counter()
    prefix_changes: Counter[str] = Counter()
    tied: dict[str, str] = {}
    covered: set[str] = set()
    one_to_one: dict[str, str] = {}
    for key, name in mapping.items():
        if key in converted:
            continue
        if name in tied_targets and name not in params:
            tied[key] = tied_targets[name]
            covered.add(name)
            continue
        if name not in state_names:
            pattern = next((p for p in ignore_unexpected if re.search(p, key) or re.search(p, name)), None)
            if pattern is not None:  # e.g. Qwen3.5's multi-token-prediction head `mtp.*`: not part of this model
                ignored[pattern] += 1
                continue
            hint = f" (renamed to {name})" if name != key else ""
            problems.append(f"checkpoint key {key}{hint} matches no model parameter (unexpected key)")
            continue
        covered.add(name)
        one_to_one[key] = name
        if name != key:
            prefix_changes[_prefix_rule(key, name)] += 1
        t = tensors.get(name)
        if t is not None and logical_shape(t) != entries[key].shape:
            problems.append(f"checkpoint key {key}: shape {list(entries[key].shape)} but model {name} has "
                            f"logical shape {list(logical_shape(t))}")
    for name in sorted(state_names - covered):
        if name in tied_targets:
            continue  # e.g. lm_head.weight tied to the embedding, absent from the checkpoint
        if any(re.search(p, name) for p in ignore_missing):
            continue
        if name not in params and not _persistent_buffer(model, name):
            continue
        if converted:
            continue  # a converter produced it; transformers' own missing_keys covers this case
        problems.append(f"model parameter {name} has no checkpoint key (missing key: it would train from random init)")
    if problems:
        raise LoadError(f"load verification failed for {model_dir} ({len(problems)} problems):\n  - "
                        + "\n  - ".join(problems[:50]))
    partitioned = sum(1 for p in params.values() if hasattr(p, "ds_shape") and p.numel() == 0)
    report = LoadReport(entries=len(entries), mapping=one_to_one, prefix_changes=dict(prefix_changes), tied=tied,
                        converted=converted, ignored=dict(ignored), partitioned=partitioned, parameters=len(state_names))
    return report, entries


def _persistent_buffer(model, name: str) -> bool:
    module_name, _, buf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:  # bitsandbytes' quantization state (q_proj.weight.absmax): no module's buffer
        return False
    return buf in getattr(module, "_buffers", {}) and buf not in getattr(module, "_non_persistent_buffers_set", set())


def verify_values(model, model_dir: str | Path, report: LoadReport, entries: dict[str, CheckpointEntry], *,
                  rank: int = 0, world_size: int = 1) -> int:
    """Compare every 1:1 checkpoint tensor with the loaded parameter (cast to the parameter's dtype, exact).

    Collective under ZeRO-3: every rank must call it with the same report. Returns the number of entries
    verified (all ranks together); raises LoadError naming the first differing keys.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    keys = sorted(report.mapping)
    # Tied keys are compared against the tensor they share.
    keys += sorted(report.tied)
    target = {**report.mapping, **report.tied}
    groups, cur, size = [], [], 0
    for k in keys:
        n = 1
        for d in entries[k].shape:
            n *= d
        if cur and size + n > GATHER_NUMEL:
            groups.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    if cur:
        groups.append(cur)
    handles: dict[str, object] = {}
    bad: list[str] = []
    checked = 0
    i = 0
    try:
        for group in groups:
            params = [tensors[target[k]] for k in group]
            with gathered(params):
                for k, p in zip(group, params):
                    if i % world_size == rank:  # each rank compares its share; all ranks gathered together
                        file = entries[k].file
                        if file not in handles:
                            handles[file] = safe_open(str(model_dir / file), framework="pt")
                        want = handles[file].get_tensor(k).to(p.dtype)
                        got = p.detach().to("cpu")
                        if got.shape != want.shape or not torch.equal(got, want):
                            diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else None
                            bad.append(f"{k} -> {target[k]}: values differ (max abs diff {diff})")
                        checked += 1
                    i += 1
    finally:
        handles.clear()
    total_checked, all_bad = _gather_counts(checked, bad, world_size)
    if all_bad:
        raise LoadError(f"--verify-load: {len(all_bad)} of {len(keys)} checkpoint entries differ from the loaded "
                        "model:\n  - " + "\n  - ".join(all_bad[:50]))
    return total_checked


def _gather_counts(checked: int, bad: list[str], world_size: int) -> tuple[int, list[str]]:
    if world_size == 1 or not torch.distributed.is_initialized():
        return checked, bad
    out: list = [None] * world_size
    torch.distributed.all_gather_object(out, (checked, bad))
    return sum(c for c, _ in out), [b for _, bs in out for b in bs]
