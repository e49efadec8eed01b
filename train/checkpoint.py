"""Saving what training produced, and resuming a run where it stopped.

- LoRA: the adapter in PEFT format (RUN/adapter: adapter_config.json + adapter_model.safetensors). Under
  ZeRO-3 the trainable tensors are gathered first (a collective on every rank); rank 0 writes. Trainable
  non-LoRA tensors (--unfreeze-vision/--unfreeze-merger) go to non_lora_trainables.safetensors beside it,
  the convention LLaVA uses. saved_tensors.json records a sha256 of every tensor as it was in memory, so
  `python -m train.verify_adapter RUN` can tell a damaged file from a faithful one.
- Full fine-tune: 16-bit weights gathered on save (ZeRO-3's consolidated state dict), written by rank 0
  with `save_pretrained` into RUN/model, so plain `from_pretrained(RUN/model)` loads them.
- Checkpoints: DeepSpeed's own engine.save_checkpoint (module, optimizer, scheduler) under
  RUN/checkpoints/<tag>, plus one trainer_state_rank{r}.pt per rank: the global step reached, the plan
  fingerprint and every RNG state, so a resumed run trains exactly the sample ids (and dropout masks) the
  interrupted run would have. A checkpoint is complete only once its checkpoint.json exists: rank 0 writes
  it last, after a barrier, listing every file of every rank with its size; `latest` is written after it
  (DeepSpeed's own `latest` is turned off, it named a tag before the trainer state was on disk).
  `--resume RUN` takes the newest complete checkpoint and reports every newer one it skipped and why; a
  kill at any point of a save leaves the previous checkpoint usable.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from train.faults import maybe_kill
from train.zero import gathered

ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
CHECKPOINTS = "checkpoints"
DIGESTS = "saved_tensors.json"
NON_LORA = "non_lora_trainables.safetensors"
MARKER = "checkpoint.json"  # written last: its presence is what makes a checkpoint complete
LATEST = "latest"
TAG_RE = re.compile(r"step(\d{6,})")


class ResumeError(RuntimeError):
    """The checkpoint cannot continue this run (different plan, world size, or missing files)."""


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def trainable_state(model) -> dict[str, torch.Tensor]:
    """name -> full (gathered) copy of every trainable tensor, on every rank. Collective under ZeRO-3."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with gathered([p for _, p in named]):
        return {n: p.detach().to("cpu").clone() for n, p in named}


def save_adapter(model, run_dir: Path, *, rank: int, tokenizer, base_dir: Path) -> Path:
    """PEFT adapter of a LoRA model (all ranks call; rank 0 writes). Returns the adapter directory.

    adapter_config.json names the base model by its absolute path, so `AutoPeftModel.from_pretrained(RUN/adapter)`
    works from any working directory; the tokenizer and processor files go beside it (AutoProcessor)."""
    from safetensors.torch import load_file, save_file

    from train.models import save_processor

    out = Path(run_dir) / ADAPTER_DIR
    state = trainable_state(model)
    if rank != 0:
        return out
    lora = {k: v for k, v in state.items() if "lora_" in k}
    other = {k: v for k, v in state.items() if "lora_" not in k}
    out.mkdir(parents=True, exist_ok=True)
    base = str(Path(base_dir).resolve())
    for cfg in model.peft_config.values():
        cfg.base_model_name_or_path = base
    model.save_pretrained(str(out), state_dict=lora, safe_serialization=True)
    digests = {"adapter_model.safetensors": {}, NON_LORA: {}}
    # Record what the file must hold, from the in-memory tensors, keyed by the names PEFT wrote.
    written = load_file(str(out / "adapter_model.safetensors"))
    by_memory = {_peft_file_key(k): v for k, v in lora.items()}
    for key, tensor in written.items():
        if key not in by_memory:
            raise RuntimeError(f"adapter file holds {key}, which no trainable LoRA tensor maps to")
        digests["adapter_model.safetensors"][key] = tensor_sha256(by_memory[key])
    if len(written) != len(lora):
        raise RuntimeError(f"PEFT wrote {len(written)} adapter tensors for {len(lora)} trainable LoRA tensors")
    if other:
        base = {_base_key(k): v.contiguous() for k, v in other.items()}
        save_file(base, str(out / NON_LORA), metadata={"format": "pt"})
        digests[NON_LORA] = {k: tensor_sha256(v) for k, v in base.items()}
    (out / DIGESTS).write_text(json.dumps(digests, indent=1))
    save_processor(out, model_config=model.get_base_model().config, tokenizer=tokenizer, source_dir=base_dir)
    return out


def _peft_file_key(name: str) -> str:
    """Model parameter name -> the key PEFT writes: the adapter name ('.default') is dropped."""
    return name.replace(".default.", ".")


def _base_key(name: str) -> str:
    """PEFT-wrapped parameter name -> the base model's name (what from_pretrained models call it)."""
    return name.removeprefix("base_model.model.")


def save_full(engine, model, run_dir: Path, *, rank: int, tokenizer, base_dir: Path, zero_stage: int,
              dtype=torch.bfloat16) -> Path:
    """16-bit weights of a full fine-tune, loadable with from_pretrained, and the tokenizer and processor
    files, loadable with AutoProcessor (all ranks call; rank 0 writes)."""
    from train.models import save_processor

    out = Path(run_dir) / MODEL_DIR
    if zero_stage == 3:  # the run's one resolved stage (train.config.resolve_deepspeed_config)
        state = engine._zero3_consolidated_16bit_state_dict()  # gathered layer by layer onto rank 0
    else:
        state = model.state_dict() if rank == 0 else None
    if rank != 0:
        return out
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    # Digests of what was in memory, keyed like the files save_pretrained wrote (tied copies are left out).
    from safetensors import safe_open

    digests: dict[str, dict[str, str]] = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
        missing = [k for k in keys if k not in state]
        if missing:
            raise RuntimeError(f"save_pretrained wrote keys the state dict does not have: {missing[:5]}")
        digests[path.name] = {k: tensor_sha256(state[k]) for k in keys}
    (out / DIGESTS).write_text(json.dumps(digests, indent=1))
    save_processor(out, model_config=model.config, tokenizer=tokenizer, source_dir=base_dir)
    return out


# ---------------------------------------------------------------------------------------------------------
# Checkpoints and resume


@dataclasses.dataclass
class TrainerState:
    """What DeepSpeed's checkpoint does not hold; one per rank."""

    global_step: int  # optimizer steps completed; training resumes at this 0-based global step
    plan_sha256: str  # fingerprint of the whole run plan; a resumed run must plan identically
    world_size: int
    rng: dict  # python / numpy / torch (cpu + cuda) RNG states of this rank


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def tag_for(step: int) -> str:
    return f"step{step:06d}"


def trainer_state_name(rank: int) -> str:
    return f"trainer_state_rank{rank}.pt"


@dataclasses.dataclass(kw_only=True)
class CheckpointMarker:
    """checkpoint.json: what a complete checkpoint holds. Written by rank 0 after every rank's files are on disk."""

    tag: str
    global_step: int
    world_size: int
    plan_sha256: str
    files: dict[str, int]  # every file of every rank, path relative to the checkpoint directory -> size in bytes

    @classmethod
    def read(cls, path: Path) -> "CheckpointMarker":
        data = json.loads(Path(path).read_text())
        return cls(tag=str(data["tag"]), global_step=int(data["global_step"]), world_size=int(data["world_size"]),
                   plan_sha256=str(data["plan_sha256"]), files={str(k): int(v) for k, v in data["files"].items()})


def _fsync_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file and a rename, flushed to disk: a reader sees all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listing(ckpt: Path) -> dict[str, int]:
    return {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")}


def save_checkpoint(engine, run_dir: Path, *, global_step: int, plan_sha256: str, rank: int, world_size: int) -> Path:
    """engine.save_checkpoint + this rank's TrainerState, then (after a barrier) checkpoint.json and `latest`.
    Collective. Returns the checkpoint directory."""
    root = Path(run_dir) / CHECKPOINTS
    tag = tag_for(global_step)
    ckpt = root / tag
    if rank == 0 and ckpt.exists():
        # A resumed run saves again at a step whose earlier save was skipped as incomplete: start clean, so
        # no stale file (or stale checkpoint.json) can pass for part of this save.
        shutil.rmtree(ckpt)
    torch.distributed.barrier()
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    state = TrainerState(global_step=global_step, plan_sha256=plan_sha256, world_size=world_size, rng=rng_state())
    maybe_kill("checkpoint_state", global_step, rank)  # fault injection: DeepSpeed's files written, ours not
    buf = io.BytesIO()
    torch.save(dataclasses.asdict(state), buf)
    _fsync_write(ckpt / trainer_state_name(rank), buf.getvalue())
    torch.distributed.barrier()  # every rank's DeepSpeed files and trainer state are on disk
    # Each rank lists what it sees; they must agree (a shared filesystem, as DeepSpeed's loader assumes).
    views: list = [None] * world_size
    torch.distributed.all_gather_object(views, _listing(ckpt))
    if rank == 0:
        differ = [r for r, v in enumerate(views) if v != views[0]]
        if differ:
            raise RuntimeError(f"checkpoint {ckpt}: ranks {differ} see other files than rank 0 "
                               "(checkpoints need a directory every rank shares)")
        missing = [trainer_state_name(r) for r in range(world_size) if trainer_state_name(r) not in views[0]]
        if missing:
            raise RuntimeError(f"checkpoint {ckpt}: {missing} not written after the barrier")
        for name in views[0]:  # the marker must not reach the disk before what it vouches for
            with open(ckpt / name, "rb") as f:
                os.fsync(f.fileno())
        maybe_kill("checkpoint_marker", global_step, rank)
        marker = CheckpointMarker(tag=tag, global_step=global_step, world_size=world_size, plan_sha256=plan_sha256,
                                  files=views[0])
        _fsync_write(ckpt / MARKER, json.dumps(dataclasses.asdict(marker), indent=1).encode())
        maybe_kill("checkpoint_latest", global_step, rank)
        _fsync_write(root / LATEST, tag.encode())
    torch.distributed.barrier()  # nobody reports the checkpoint before it is complete
    return ckpt


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed from (None when it is complete): no marker, or a listed file missing or
    of another size."""
    marker_path = Path(ckpt) / MARKER
    if not marker_path.exists():
        return f"no {MARKER} (the save did not finish, or a version without completeness markers wrote it)"
    try:
        marker = CheckpointMarker.read(marker_path)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MARKER} is unreadable ({type(e).__name__}: {e})"
    if marker.tag != Path(ckpt).name:
        return f"{MARKER} belongs to {marker.tag}"
    for name in (trainer_state_name(r) for r in range(marker.world_size)):
        if name not in marker.files:
            return f"{MARKER} does not list {name}"
    for name, size in marker.files.items():
        path = Path(ckpt) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, {MARKER} says {size}"
    return None


@dataclasses.dataclass(kw_only=True)
class CheckpointChoice:
    """The checkpoint a resume starts from, and the newer ones it passed over."""

    path: Path  # RUN/checkpoints/<tag>
    skipped: list[dict]  # {"tag", "reason"} of every newer checkpoint directory, newest first
    latest: str | None  # what RUN/checkpoints/latest names (None: missing); informative only

    @property
    def tag(self) -> str:
        return self.path.name


def find_checkpoint(resume_dir: Path) -> CheckpointChoice:
    """The newest complete checkpoint of a run directory. `latest` is not trusted: a kill can leave it naming
    (or it can be emptied) a checkpoint that is not complete; checkpoint.json decides."""
    root = Path(resume_dir) / CHECKPOINTS
    if not root.is_dir():
        raise ResumeError(f"{root} not found: {resume_dir} has no checkpoint (train with --save-every N)")
    latest_path = root / LATEST
    latest = latest_path.read_text().strip() if latest_path.is_file() else None
    tags = sorted((p for p in root.iterdir() if p.is_dir() and TAG_RE.fullmatch(p.name)),
                  key=lambda p: int(TAG_RE.fullmatch(p.name).group(1)), reverse=True)
    skipped = []
    for path in tags:
        why = checkpoint_problem(path)
        if why is None:
            return CheckpointChoice(path=path, skipped=skipped, latest=latest)
        skipped.append({"tag": path.name, "reason": why})
    detail = "; ".join(f"{s['tag']}: {s['reason']}" for s in skipped) or "no step* directories"
    raise ResumeError(f"{root} holds no complete checkpoint ({detail})")


def load_checkpoint(engine, choice: CheckpointChoice, *, rank: int, world_size: int, plan_sha256: str) -> TrainerState:
    """Restore module, optimizer and scheduler (DeepSpeed), then check the plan; RNG is restored by the
    caller right before the loop (set_rng_state) so nothing in between consumes it."""
    root, tag = choice.path.parent, choice.tag
    if torch.distributed.is_initialized() and world_size > 1:
        tags: list = [None] * world_size
        torch.distributed.all_gather_object(tags, tag)
        if len(set(tags)) != 1:
            raise ResumeError(f"ranks chose different checkpoints to resume from: {tags}")
    path = choice.path / trainer_state_name(rank)
    if not path.exists():
        raise ResumeError(f"{path} not found: the checkpoint {tag} was written by fewer ranks than {world_size}")
    state = TrainerState(**torch.load(path, weights_only=False))
    problems = []
    if state.world_size != world_size:
        problems.append(f"it was written by {state.world_size} ranks, this run has {world_size}")
    if state.plan_sha256 != plan_sha256:
        problems.append("its data plan differs from this run's (manifest, seed, batch size, accumulation, tail or "
                        "epochs changed); resuming would not train the same samples")
    if problems:
        raise ResumeError(f"cannot resume from {choice.path}: " + "; ".join(problems))
    load_path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise ResumeError(f"DeepSpeed could not load the checkpoint {choice.path}")
    return state


def carry_ledger(resume_dir: Path, run_dir: Path, rank: int, before_step: int) -> int:
    """A resumed run continues the ledger: keep the lines of steps < before_step (in place, or copied to a
    new run directory). Returns the lines kept."""
    from train.ledger import ledger_path, truncate_ledger

    src, dst = ledger_path(resume_dir, rank), ledger_path(run_dir, rank)
    if Path(resume_dir).resolve() == Path(run_dir).resolve():
        truncate_ledger(run_dir, rank, before_step)
    elif src.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        lines = [ln for ln in src.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < before_step]
        dst.write_text("".join(ln + "\n" for ln in lines))
    return len(dst.read_text().splitlines()) if dst.exists() else 0


def plan_fingerprint(plans) -> str:
    return hashlib.sha256(json.dumps([p.to_json() for p in plans], sort_keys=True).encode()).hexdigest()
