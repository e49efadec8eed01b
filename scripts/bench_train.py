"""Training-step benchmark: train.main configurations next to the plain stack, in one call on one machine.

Each leg is one `train.main` run (torchrun, --nproc ranks) over synthetic shards: --frames frames per window
at --tokens-per-frame merged tokens per temporal group (a square video sized so the budget gives exactly
that grid: 196 -> [frames/2, 28, 28]), or one run of the plain-stack anchor script
(shared/anchors/plain_stack_step.py) with the same geometry. --mem-cap GiB caps every leg's CUDA memory
(torch per-process memory fraction: a small card). Per leg (first step excluded):

- step_s: median seconds per optimizer step; tokens_per_s: input tokens of all ranks per second;
- mfu: useful FLOPs per step (train/flops.py: LoRA 4·N·T on the language model, causal attention with
  recompute, the lm_head at supervised positions, the vision forward) / (step_s x ranks x the GPU's dense
  bf16 peak: train.flops.PEAK_BF16_TFLOPS or --peak-tflops);
- peak allocated / reserved GiB per phase (rank 0, and the max over ranks), next to the memory planner's
  prediction for the configuration the run resolved (train/memplan.py) and its error;
- data_wait_share: median share of the step spent waiting for the loader (the `data` phase);
- loss vs ref: the largest relative difference of the leg's per-step losses from the `zero2` leg's (else
  `auto`'s) at the same size and frames: same seed, same windows, so a lever that changes the math shows here
  (issue 9 asks for <= 1e-2 over 5 steps).

Legs are named configurations (LEGS below) at a size and frame count: `auto` is the stack that ships (the
planner picks), `plain` is the original Video-ORA setup through train.main, the others move one lever.
Results go to OUT/results.jsonl as each leg ends (a killed call keeps what finished), OUT/results.json and
a markdown table at the end; OUT/env.json records the package versions and devices.

  python -m scripts.bench_train --legs anchor,auto,plain,zero2,zero3 --frames 64 --nproc 1 --out /tmp/bt \\
      [--mem-cap 12] [--size qwen3_vl_4b] [--budget-s 560]
  python -m scripts.bench_train --matrix issue9 --out $OUT/bench     # everything issue 9 asks for, by priority
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The plain-stack anchor script: inside the checkout (how a device call carries it) or beside it.
ANCHORS = (REPO / "shared" / "anchors" / "plain_stack_step.py", REPO.parent / "shared" / "anchors" / "plain_stack_step.py")
TOKENS_PER_GROUP = 196

# name -> train.main flags. {pack_budget} becomes twice the window's input tokens (two windows per row).
LEGS: dict[str, tuple[str, ...]] = {
    "auto": (),
    "plain": ("--preset", "video-ora-zero3", "--full-logits", "--no-vision-no-grad", "--vision-chunk-frames", "0",
              "--gradient-checkpointing", "all"),
    # the reference path of the loss column: no fused kernels (auto turns liger's on for Qwen3-VL on CUDA)
    "zero2": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--no-liger-kernels"),
    "zero3": ("--zero-stage", "3", "--gradient-checkpointing", "all"),
    # ZeRO-3 on one rank keeps every parameter whole by default (train/config.py); this is the partitioned
    # path multi-GPU runs take (1e4 persistence: each leaf layer gathered and released every pass)
    "zero3-partitioned": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--param-persistence-threshold", "1e4"),
    # DeepSpeed's per-submodule hooks (what ZeRO-3 did before leaf layers; the original run's behaviour)
    "zero3-hooks": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--no-zero3-leaf-layers"),
    "zero3-big-buckets": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--reduce-bucket-size", "5e8",
                          "--prefetch-bucket-size", "5e8", "--param-persistence-threshold", "1e6"),
    "zero2-ckpt-none": ("--zero-stage", "2", "--gradient-checkpointing", "none"),
    "zero2-every-2": ("--zero-stage", "2", "--gradient-checkpointing", "every-2"),
    "zero2-loss-torch": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--loss-impl", "torch"),
    "zero2-liger": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--loss-impl", "liger"),
    "zero2-liger-kernels": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--liger-kernels"),
    "auto-no-liger-kernels": ("--no-liger-kernels",),
    "auto-compile": ("--compile", "--no-liger-kernels"),
    "zero2-compile": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--compile", "--no-liger-kernels"),
    # two profiled steps after the first (RUN/profile/kernels_rank0.txt: where the step goes); not for timing
    "auto-profile": ("--profile-steps", "2"),
    "zero3-profile": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--profile-steps", "2"),
    # the step-overhead levers that ship on, each turned off alone
    "auto-no-batched-vision": ("--no-batched-vision-attention",),
    "auto-no-fused-grad-checks": ("--no-fused-grad-checks",),
    # checkpointed layers keep their attention output (the long-window lever: only the cheap part recomputed)
    "auto-keep-attention": ("--no-recompute-attention",),
    "auto-recompute-attention": ("--recompute-attention",),  # what auto picked before it could keep them
    "auto-liger-kernels": ("--liger-kernels",),  # = auto since 3c12321 (liger on by default for Qwen3.5 too)
    # one rank, every parameter whole, DeepSpeed's own way: its memory-efficient linear and its release of every
    # parameter around each step (an explicit threshold leaves both; train.config.keeps_parameters_whole)
    "zero3-ds-linear": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--param-persistence-threshold", "1e14"),
    "zero2-profile": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--liger-kernels", "--profile-steps", "2"),
    # LoRA dropout's output and mask kept per projection, PEFT's own way (train/lora_dropout.py)
    "auto-no-recompute-lora-dropout": ("--no-recompute-lora-dropout",),
    # q/k/v and gate/up LoRA branches each as their own autograd nodes, as before train/lora_dropout.py's groups
    "auto-no-sibling-lora": ("--no-sibling-lora",),
    # one GPU: DeepSpeed's ZeRO-2 optimizer (auto's pick before train/adamw.py) instead of stage 0 + the trainer's AdamW
    "auto-no-plain-adamw": ("--no-plain-adamw",),
    # 512f: session 11's pick (19 layers whole, attention kept) with today's levers, beside auto's all-but-25: what
    # the down projection's product lever (train/lora_dropout.py) buys alone
    "auto-all-but-19": ("--gradient-checkpointing", "all-but-19", "--no-recompute-attention"),
    "zero3-no-fused-grad-checks": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--no-fused-grad-checks"),
    # ZeRO-3 on one rank with every parameter whole: nothing to prefetch, so the prefetch bookkeeping off
    "zero3-no-prefetch": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--prefetch-bucket-size", "1"),
    "zero2-vision-in-forward": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--no-vision-no-grad",
                                "--vision-chunk-frames", "0"),
    "zero2-eager": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--attention", "eager"),
    "zero2-fa2": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--attention", "flash_attention_2"),
    "zero2-offload-act": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--offload-activations"),
    "zero2-nf4": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--quantize-base", "nf4"),
    "zero2-int8": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--quantize-base", "int8"),
    "zero3-offload-opt": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--offload-optimizer"),
    "zero3-offload-params": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--offload-optimizer",
                             "--offload-params"),
    "pack2": ("--pack", "--max-tokens-per-batch", "{pack_budget}"),
    # the packed row under transformers' dense block-diagonal mask instead of sdpa per sample (train/packing.py)
    "pack2-mask": ("--pack", "--max-tokens-per-batch", "{pack_budget}", "--no-segment-attention"),
    # one window split over every rank (train/sequence_parallel.py); {nproc} becomes --nproc
    "zero3-sp": ("--zero-stage", "3", "--gradient-checkpointing", "all", "--sequence-parallel", "{nproc}"),
    "zero2-sp": ("--zero-stage", "2", "--gradient-checkpointing", "all", "--sequence-parallel", "{nproc}"),
    "linear-fla": ("--linear-attention", "fla"),
    "linear-torch": ("--linear-attention", "torch"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Leg:
    """One measurement: a configuration at a size, frame count and memory cap."""

    config: str  # a LEGS name, or "anchor" (the plain-stack script)
    size: str = "qwen3_vl_4b"
    frames: int = 64
    cap_gib: float | None = None
    steps: int | None = None  # None: the bench's --steps (a long leg runs fewer)

    @property
    def name(self) -> str:
        cap = f"-cap{self.cap_gib:g}" if self.cap_gib else ""
        return f"{self.size}-{self.frames}f-{self.config}{cap}"


def issue9_matrix() -> list[Leg]:
    """Every measurement issue 9 asks for, most important first (a time budget cuts from the end)."""
    vl8, q9, q4 = "qwen3_vl_8b", "qwen3_5_9b", "qwen3_5_4b"  # the 4B shape is Leg's default
    legs = [Leg(config=c) for c in ("anchor", "auto", "zero2", "zero3", "zero3-partitioned", "zero3-hooks")]
    legs += [Leg(config="auto", frames=f, cap_gib=12) for f in (64, 128, 256)]
    legs += [Leg(config="auto", frames=512), Leg(config="plain"), Leg(config="auto", frames=1024, steps=3)]
    legs += [Leg(config="auto", size=vl8), Leg(config="auto", size=q9), Leg(config="linear-torch", size=q9)]
    legs += [Leg(config=c) for c in ("zero2-ckpt-none", "zero2-loss-torch", "zero2-vision-in-forward", "zero2-eager",
                                     "zero2-offload-act", "pack2", "zero2-nf4", "zero2-fa2", "zero2-liger",
                                     "zero3-big-buckets", "zero3-offload-opt")]
    legs += [Leg(config="auto", size=q4), Leg(config="anchor", cap_gib=12), Leg(config="zero2-nf4", cap_gib=12),
             Leg(config="linear-torch", size=q4)]
    legs += [Leg(config=c) for c in ("auto-profile", "auto-no-liger-kernels", "zero2-liger-kernels", "auto-compile",
                                     "zero2-compile")]
    legs += [Leg(config=c) for c in ("auto-no-batched-vision", "auto-no-fused-grad-checks", "zero3-profile",
                                     "zero3-no-prefetch")]  # 35-38
    legs += [Leg(config="auto-keep-attention", frames=512), Leg(config="auto-liger-kernels", size=q9),
             Leg(config="auto-keep-attention", frames=1024, steps=3)]  # 39-41
    legs += [Leg(config="auto-recompute-attention", frames=512), Leg(config="zero3-no-fused-grad-checks")]  # 42-43
    legs += [Leg(config="zero3-ds-linear"), Leg(config="zero2-profile")]  # 44-45
    legs += [Leg(config="auto-no-recompute-lora-dropout", frames=f) for f in (64, 512)]  # 46-47
    legs += [Leg(config="auto-no-plain-adamw", frames=f) for f in (64, 512)]  # 48-49
    legs += [Leg(config="auto-all-but-19", frames=512)]  # 50
    legs += [Leg(config="pack2-mask")]  # 51: pack2 (two windows a row) on the dense mask, beside pack2
    legs += [Leg(config="auto-no-sibling-lora", frames=f) for f in (64, 512)]  # 52-53
    legs += [Leg(config="auto-profile", frames=512)]  # 54: where the 512-frame step goes
    return legs


def select(spec: str, n: int) -> list[int]:
    """Indices named by "0-4,7,10-" (ranges inclusive, an open end runs to the last of n), in that order."""
    out: list[int] = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not dash:
            out.append(int(lo))
        else:
            out += range(int(lo or 0), int(hi) + 1 if hi else n)
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise SystemExit(f"--select {spec!r}: no legs {bad} (the matrix has 0..{n - 1})")
    return out


# ------------------------------------------------------------------------------------------------- inputs
def make_shards(out: Path, frames: int, tokens_per_frame: int, samples: int, workers: int = 8) -> Path:
    """Square synthetic videos whose budgeted grid is [frames/2, 2s, 2s] with s*s = tokens_per_frame."""
    from prep.budget import FPS_MAX_FRAMES
    from scripts.synth_videos import VideoSpec, write_dataset

    shards = out / f"shards_{frames}f_{tokens_per_frame}t_{samples}s"
    if (shards / "build.json").exists():
        return shards
    side = int(math.isqrt(tokens_per_frame))
    if side * side != tokens_per_frame:
        raise SystemExit(f"--tokens-per-frame must be a square number, got {tokens_per_frame}")
    px = side * 32  # 2 patches of 16 px per merged token side
    window = frames / 2.0  # sampled at 2 fps
    specs = [VideoSpec(name=f"bench_{i}", duration_s=window, fps=4, width=px, height=px,
                       events=((window * 0.25, window * 0.6),), seed=i) for i in range(samples)]
    videos = write_dataset(out / f"videos_{frames}f_{tokens_per_frame}t_{samples}s", specs)
    cmd = [sys.executable, "-m", "prep", "build", "--videos", str(videos), "--out", str(shards),
           "--window-seconds", str(window), "--video-max-tokens", str(tokens_per_frame),
           "--video-min-tokens", str(min(128, tokens_per_frame)), "--workers", str(workers), "--no-progress",
           "--max-frames", str(max(frames, FPS_MAX_FRAMES))]  # above 768 frames prep's default cap would sample down
    subprocess.run(cmd, check=True, cwd=REPO, timeout=1800)
    return shards


def make_model(out: Path, size: str) -> Path:
    """The random-weight model of a train/configs shape, initialized on the GPU when there is one, in a child
    process: the bench itself never holds a CUDA context (it would count as memory used by others)."""
    model = out / f"model_{size}"
    if not (model / "config.json").exists():
        code = ("import sys, torch; from train.models import create_random_model; "
                "create_random_model(sys.argv[1], sys.argv[2], dtype=torch.bfloat16, "
                "device='cuda' if torch.cuda.is_available() else 'cpu')")
        subprocess.run([sys.executable, "-c", code, size, str(model)], check=True, cwd=REPO, timeout=1200,
                       env=child_env())
    return model


def build_cpu_adam(timeout: float = 900) -> float:
    """Build DeepSpeed's CPU Adam op (seconds taken) before the first leg that may offload the optimizer (the
    planner picks that under a memory cap): untimed there, and never inside a leg whose timeout could kill it
    mid-build. A killed build leaves torch's lock file, and the next leg then waits on it (session 10)."""
    t = time.time()
    try:
        subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
                       check=True, cwd=REPO, timeout=timeout, env=child_env(), capture_output=True, text=True)
    except subprocess.CalledProcessError as e:  # the leg then fails on its own, with DeepSpeed's words
        print(f"bench: building DeepSpeed's CPU Adam op failed:\n{(e.stderr or '')[-2000:]}", file=sys.stderr)
    return round(time.time() - t, 1)


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi (no CUDA context in this process), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else None


def environment() -> dict:
    """Package versions and devices, recorded with every result."""
    from importlib import metadata

    versions = {}
    for pkg in ("torch", "transformers", "deepspeed", "peft", "triton", "flash-linear-attention", "fla-core",
                "causal-conv1d", "flash-attn", "liger-kernel", "bitsandbytes", "accelerate"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = None  # no GPU here
    return {"python": sys.version.split()[0], "packages": versions, "nvidia_smi": smi,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


# ------------------------------------------------------------------------------------------------- running
def child_env() -> dict:
    """This environment with the checkout first on PYTHONPATH (kept: carried packages live there too)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def launcher(nproc: int) -> list[str]:
    if nproc <= 0:  # one plain process (CPU tests)
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(_free_port())]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(*, flags: list[str], shards: Path, run: Path, model: Path, steps: int, nproc: int,
                  cap_gib: float | None, num_workers: int = 2) -> list[str]:
    cmd = launcher(nproc) + ["-m", "train.main", "--shards", str(shards), "--output-dir", str(run), "--model",
                             str(model), "--max-steps", str(steps), "--tail", "pad", "--save-every", "0",
                             "--num-workers", str(num_workers), "--no-progress", *flags]
    if cap_gib:
        cmd += ["--mem-cap-gib", str(cap_gib)]
    return cmd


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run cmd with its output in `log`; its whole process group is killed on timeout. (rc, wall s)."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env=child_env())
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
    return rc, round(time.time() - t0, 1)


def run_stats(run: Path, *, model: Path | None = None, peak_tflops: float | None = None) -> dict:
    """Step time, throughput, MFU, per-phase memory, data wait and the planner's prediction of a train.main run."""
    steps: dict[int, list[dict]] = {}
    for f in sorted((run / "logs").glob("rank*.jsonl")):
        for line in open(f):
            row = json.loads(line)
            if row.get("event") == "step":
                steps.setdefault(row["rank"], []).append(row)
    out: dict = {"steps": len(steps.get(0, []))}
    oom = sorted(run.glob("oom_rank*.json"))
    if oom:
        rep = json.loads(oom[0].read_text())
        out["oom"] = {"phase": rep.get("phase"), "global_step": rep.get("global_step")}
    if not steps.get(0):
        return out
    rank0 = steps[0]
    timed = rank0[1:] or rank0
    world = len(steps)
    step_s = statistics.median(r["seconds"] for r in timed)
    tokens = statistics.median(sum(steps[r][i]["input_tokens"] for r in steps if i < len(steps[r]))
                               for i in range(len(rank0)))
    phases: dict[str, dict] = {}
    for r, rows in steps.items():
        for row in rows:
            for ph, v in row["phase_memory"].items():
                cur = phases.setdefault(ph, {"alloc_gib": 0.0, "reserved_gib": 0.0, "alloc_gib_rank0": 0.0})
                cur["alloc_gib"] = max(cur["alloc_gib"], v["alloc_gib"])
                cur["reserved_gib"] = max(cur["reserved_gib"], v["reserved_gib"])
                if r == 0:
                    cur["alloc_gib_rank0"] = max(cur["alloc_gib_rank0"], v["alloc_gib"])
    out.update(step_s=round(step_s, 3), step_s_all=[r["seconds"] for r in rank0], tokens_per_step=tokens,
               tokens_per_s=round(tokens / step_s, 1), world=world,
               input_tokens=rank0[0]["input_tokens"], supervised_tokens=rank0[0]["supervised_tokens"],
               peak_alloc_gib=max(r["peak_alloc_gib"] for rows in steps.values() for r in rows),
               peak_reserved_gib=max(r["peak_reserved_gib"] for rows in steps.values() for r in rows),
               memory_kind=rank0[0]["memory_kind"], phase_memory=phases,
               data_wait_share=round(statistics.median(r.get("data_wait_share") or 0.0 for r in timed), 4),
               loss_last=rank0[-1]["loss"], losses=[r["loss"] for r in rank0])
    record = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
    cfg = record.get("config", {})
    out["resolved"] = {k: cfg.get(k) for k in ("zero_stage", "gradient_checkpointing", "offload_activations",
                                                "offload_optimizer", "offload_params", "loss_impl", "quantize_base",
                                                "attention", "pack", "vision_chunk_frames", "full_logits")}
    if model is not None:
        out.update(_prediction_and_mfu(run, cfg, model, step_s=step_s, world=world, peak_tflops=peak_tflops,
                                       measured=out["peak_alloc_gib"]))
    return out


def _prediction_and_mfu(run: Path, cfg: dict, model: Path, *, step_s: float, world: int, peak_tflops: float | None,
                        measured: float) -> dict:
    from schemas.manifest import SampleRecord, read_records
    from train.flops import peak_tflops as device_peak, step_flops
    from train.memplan import Setup, config_levers, heaviest_workload, predict
    from train.plan import MicroBatch
    from train.shapes import ModelShape

    shape = ModelShape.from_dir(model, lora_targets=cfg.get("lora_targets"))
    plans = json.loads((run / "plan.json").read_text())["plans"]
    mbs = [MicroBatch.from_json(mb) for p in plans for step in p["steps"] for rank in step for mb in rank]
    records = read_records(Path(cfg["shards"]) / "manifest.parquet", SampleRecord)
    work = heaviest_workload(records, mbs, pack=bool(cfg.get("pack")), merge=shape.merge)
    loss = "model" if cfg.get("full_logits") else ("torch" if cfg.get("loss_impl") == "torch" else "chunked")
    if cfg.get("loss_impl") == "liger":
        loss = "liger"
    setup = Setup(zero_stage=int(cfg["zero_stage"]), checkpointing=cfg["gradient_checkpointing"],
                  offload_activations=bool(cfg.get("offload_activations")), quantize_base=cfg.get("quantize_base"),
                  offload_optimizer=bool(cfg.get("offload_optimizer")), offload_params=bool(cfg.get("offload_params")),
                  prefetch_bucket=float(cfg.get("prefetch_bucket_size") or 5e6), loss=loss,
                  fused_kernels=bool(cfg.get("liger_kernels")),
                  **config_levers(cfg),
                  vision_chunk_frames=int(cfg.get("vision_chunk_frames") or 0), finetune=cfg.get("finetune", "lora"),
                  lora_r=int(cfg.get("lora_r", 8)), lora_dropout=float(cfg.get("lora_dropout", 0.05)) > 0)
    pred = predict(shape, work, setup, world=world)
    by_id = {r.sample_id: r for r in records}
    flops = 0.0
    first_step = [MicroBatch.from_json(mb) for rank in plans[0]["steps"][0] for mb in rank]
    for mb in first_step:  # one optimizer step: every rank's micro-batches (the bench's steps all look alike)
        rs = [by_id[s] for s in mb.sample_ids]
        flops += step_flops(shape, tokens=sum(r.input_tokens for r in rs), supervised=sum(r.supervised_tokens for r in rs),
                            patches=sum(r.grid_t * r.grid_h * r.grid_w for r in rs),
                            patches_per_group=max(r.grid_h * r.grid_w for r in rs),
                            sample_tokens=[r.input_tokens for r in rs] if cfg.get("pack") else None,
                            full_finetune=cfg.get("finetune") == "full")["total"]
    peak = peak_tflops
    if peak is None and (name := gpu_name()) is not None:
        peak = device_peak(name)
    out = {"predicted_peak_gib": round(pred.peak_gib, 2), "predicted_phases_gib": {k: round(v, 2) for k, v in pred.phases.items()},
           "prediction_error": round(pred.peak_gib / measured - 1, 3) if measured else None,
           "useful_tflop_per_step": round(flops / 1e12, 2)}
    if peak:
        out["mfu"] = round(flops / (step_s * world * peak * 1e12), 3)
        out["peak_tflops_per_gpu"] = peak
    return out


def find_anchor(given: str | None = None) -> Path | None:
    for path in ([Path(given)] if given else []) + list(ANCHORS):
        if path.is_file():
            return path
    return None


def run_anchor(leg: Leg, *, out: Path, nproc: int, steps: int, timeout: float, anchor: str | None = None) -> dict:
    script = find_anchor(anchor)
    if script is None:
        return {"error": f"anchor script not found (looked at {', '.join(str(p) for p in ANCHORS)}; pass --anchor)"}
    size = leg.size.split("_")[-1]  # qwen3_vl_4b -> 4b
    cmd = launcher(max(nproc, 1)) + [str(script), "--size", size, "--frames", str(leg.frames),
                                     "--tokens-per-frame", str(TOKENS_PER_GROUP), "--steps", str(steps)]
    if leg.cap_gib:
        cmd += ["--mem-gib", str(leg.cap_gib)]
    log = out / f"{leg.name}.log"
    rc, wall = run_logged(cmd, log, timeout)
    lines = [json.loads(ln[7:]) for ln in log.read_text().splitlines() if ln.startswith("RESULT ")]
    res: dict = {"rc": rc, "wall_s": wall, "ranks": lines}
    if lines:
        r0 = lines[0]
        res.update(step_s=r0["step_s_median"], peak_alloc_gib=r0["peak_alloc_gib"], peak_reserved_gib=r0["peak_reserved_gib"],
                   tokens_per_s=r0["tokens_per_s"], input_tokens=r0["input_tokens"])
    elif "OutOfMemoryError" in log.read_text() or "out of memory" in log.read_text():
        res["oom"] = True
    return res


def run_leg(leg: Leg, *, out: Path, nproc: int, steps: int, timeout: float, peak_tflops: float | None,
            tokens_per_frame: int = TOKENS_PER_GROUP, workers: int = 8, anchor: str | None = None,
            work: Path | None = None, samples: int | None = None) -> dict:
    """One leg; logs in `out`, models / shards / run directories in `work` (default `out`)."""
    work = work or out
    if leg.config == "anchor":
        return run_anchor(leg, out=out, nproc=nproc, steps=steps, timeout=timeout, anchor=anchor)
    steps = leg.steps or steps
    # one fresh window per rank and step: with one window per epoch the loader restarts every step and its
    # first load is on the critical path (measured: 33% data wait at 512 frames), which no real run sees
    samples = samples or max(nproc, 1) * steps * (2 if leg.config.startswith("pack2") else 1)
    shards = make_shards(work, leg.frames, tokens_per_frame, samples, workers=workers)
    model = make_model(work, leg.size)
    flags = [f.replace("{nproc}", str(max(nproc, 1))) for f in LEGS[leg.config]]
    if "{pack_budget}" in flags:
        from schemas.manifest import SampleRecord, read_records

        longest = max(r.input_tokens for r in read_records(shards / "manifest.parquet", SampleRecord))
        flags = [f.replace("{pack_budget}", str(2 * longest)) for f in flags]
    run = work / "runs" / leg.name
    shutil.rmtree(run, ignore_errors=True)  # a leg run again (a later call on a warm machine) starts clean
    cmd = train_command(flags=flags, shards=shards, run=run, model=model, steps=steps, nproc=nproc, cap_gib=leg.cap_gib)
    rc, wall = run_logged(cmd, out / f"{leg.name}.log", timeout)
    return {"rc": rc, "wall_s": wall, "flags": flags, **run_stats(run, model=model, peak_tflops=peak_tflops)}


# ------------------------------------------------------------------------------------------------- report
REFERENCE = ("zero2", "auto")  # the leg whose step losses the others are compared with (first present)


def loss_difference(row: dict, results: list[dict]) -> float | None:
    """Largest relative difference of `row`'s per-step losses from the reference leg's at the same size and
    frame count (same seed, same windows in the same order), or None without both."""
    for ref_config in REFERENCE:
        ref = next((r for r in results if r["config"] == ref_config and r["size"] == row["size"]
                    and r["frames"] == row["frames"] and r.get("losses")), None)
        if ref is not None:
            break
    else:
        return None
    mine = row.get("losses") or []
    n = min(len(mine), len(ref["losses"]))
    if not n:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine[:n], ref["losses"][:n]))


def table(results: list[dict]) -> str:
    anchors = {(r["size"], r["frames"], r.get("cap_gib")): r.get("step_s") for r in results if r["config"] == "anchor"}
    head = ("| leg | rc | step s | vs anchor | tokens/s | MFU | peak alloc GiB | predicted GiB (err) | reserved GiB "
            "| data wait | loss vs ref | resolved |")
    lines = [head, "|" + "---|" * 12]
    for r in results:
        base = anchors.get((r["size"], r["frames"], r.get("cap_gib"))) or anchors.get((r["size"], r["frames"], None))
        vs = f"{base / r['step_s']:.2f}x" if base and r.get("step_s") else ""
        pred = (f"{r['predicted_peak_gib']} ({r['prediction_error']:+.1%})"
                if r.get("predicted_peak_gib") is not None and r.get("prediction_error") is not None else "")
        res = r.get("resolved") or {}
        resolved = f"z{res.get('zero_stage')} ckpt {res.get('gradient_checkpointing')}" if res else ""
        status = ("OOM" if r.get("oom") else "skipped" if r.get("skipped") else
                  f"error: {r['error'][:60]}" if r.get("error") else r.get("rc"))
        diff = loss_difference(r, results)
        lines.append(f"| {r['leg']} | {status} | {r.get('step_s', '')} | {vs} | {r.get('tokens_per_s', '')} | "
                     f"{r.get('mfu', '')} | {r.get('peak_alloc_gib', '')} | {pred} | {r.get('peak_reserved_gib', '')} | "
                     f"{r.get('data_wait_share', '')} | {'' if diff is None else f'{diff:.1e}'} | {resolved} |")
    if any(r.get("memory_kind") == "cpu_rss" for r in results):
        lines.append("(CPU legs: memory is the process RSS stand-in; the predictions are for CUDA allocator peaks)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legs", default="anchor,auto,plain,zero2,zero3", help=f"comma list of anchor, {', '.join(LEGS)}")
    ap.add_argument("--modes", default=None, help=argparse.SUPPRESS)  # the older spelling of --legs
    ap.add_argument("--matrix", choices=("issue9",), default=None, help="a predefined list of legs (overrides "
                    "--legs/--size/--frames/--mem-cap)")
    ap.add_argument("--select", default=None, help="with --matrix: a range of its legs, e.g. 0-9 or 10- (to split "
                    "the matrix over several device calls)")
    ap.add_argument("--size", default="qwen3_vl_4b", help="a shape in train/configs")
    ap.add_argument("--frames", default="64", help="comma list, 32..1024")
    ap.add_argument("--tokens-per-frame", type=int, default=TOKENS_PER_GROUP)
    ap.add_argument("--mem-cap", type=float, default=None, help="GiB per process (a smaller card)")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (ranks); 0 = one plain process (CPU)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting legs after this many seconds")
    ap.add_argument("--leg-timeout-s", type=float, default=420)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU for MFU")
    ap.add_argument("--anchor", default=None, help="the plain-stack script (default: shared/anchors/plain_stack_step.py "
                    "in or beside the checkout)")
    ap.add_argument("--samples", type=int, default=None,
                    help="windows in the synthetic shards (default: one per rank); a count the world size does not "
                    "divide checks the ledger's tail rules at scale (the legs run with --tail pad)")
    ap.add_argument("--workers", type=int, default=8, help="prep build workers for the synthetic shards")
    ap.add_argument("--out", type=Path, default=Path("bench_train_out"), help="logs and results")
    ap.add_argument("--work", type=Path, default=None, help="models, shards and run directories (default --out)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.work is not None:
        a.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    (a.out / "env.json").write_text(json.dumps(environment(), indent=1))
    if a.modes:  # older runs (BENCHMARKS.md): --modes plain,zero2 plus an --anchor leg
        a.legs = ",".join((["anchor"] if a.anchor else []) + [m.replace("_", "-") for m in a.modes.split(",")])
    if a.matrix == "issue9":
        legs = issue9_matrix()
        if a.select:
            legs = [legs[i] for i in select(a.select, len(legs))]
    else:
        legs = [Leg(config=c, size=a.size, frames=int(f), cap_gib=a.mem_cap) for f in a.frames.split(",")
                for c in a.legs.split(",")]
    unknown = [leg.config for leg in legs if leg.config != "anchor" and leg.config not in LEGS]
    if unknown:
        raise SystemExit(f"unknown legs {unknown}; choose from anchor, {', '.join(LEGS)}")
    results = []
    cpu_adam_built = False
    for leg in legs:
        row = {"leg": leg.name, "config": leg.config, "size": leg.size, "frames": leg.frames, "cap_gib": leg.cap_gib}
        if not cpu_adam_built and (leg.cap_gib or "offload" in leg.config) and leg.config != "anchor":
            row["cpu_adam_build_s"] = build_cpu_adam()
            cpu_adam_built = True
        left = None if a.budget_s is None else a.budget_s - (time.time() - t0)
        if left is not None and left < 40:
            row["skipped"] = f"time budget ({a.budget_s:.0f} s) spent"
        else:
            timeout = a.leg_timeout_s if left is None else max(30.0, min(a.leg_timeout_s, left - 5))
            try:
                row.update(run_leg(leg, out=a.out, nproc=a.nproc, steps=a.steps, timeout=timeout,
                                   peak_tflops=a.peak_tflops, tokens_per_frame=a.tokens_per_frame, workers=a.workers,
                                   anchor=a.anchor, work=a.work, samples=a.samples))
            except (subprocess.SubprocessError, OSError, ValueError, KeyError) as e:  # recorded, next leg runs
                row["error"] = f"{type(e).__name__}: {e}"
        row["elapsed_s"] = round(time.time() - t0, 1)
        results.append(row)
        with open(a.out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("leg", "rc", "step_s", "tokens_per_s", "mfu", "peak_alloc_gib",
                                                  "predicted_peak_gib", "data_wait_share", "oom", "skipped", "error",
                                                  "elapsed_s")}), flush=True)
    (a.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                    "results": results}, indent=1))
    text = table(results)
    (a.out / "results.md").write_text(text + "\n")
    print(text)
    skipped = [r["leg"] for r in results if r.get("skipped")]
    if skipped:
        print(f"skipped for time: {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
