"""Training step benchmark at real model sizes (random weights): our trainer in several configurations,
side by side in one run on the same machine, optionally next to the plain-stack anchor script.

Each mode is one `torchrun --nproc_per_node N -m train.main ...` over the same shards: one window of
`--frames` frames at `--tokens-per-frame` visual tokens per temporal group (a square synthetic video sized
so the budget gives exactly that grid, e.g. 64 frames x 196 tokens -> grid [32, 28, 28]). Reported per
mode: median step seconds (first step excluded), tokens/s, peak allocated / reserved GiB per rank and phase.

Run (GPU): python -m scripts.bench_train --size qwen3_vl_4b --frames 64 --tokens-per-frame 196 --nproc 2 \
               --steps 6 --modes zero3,zero2 --out bench_out [--anchor path/to/plain_stack_step.py]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name -> extra train.main flags. "plain" = the original Video-ORA setup (ZeRO-3, 5e6 buckets, logits at
# every position), the stack the anchor measures.
MODES = {
    "plain": ["--zero-stage", "3", "--full-logits"],
    "zero3": ["--zero-stage", "3"],
    "zero2": ["--zero-stage", "2"],
    "zero3_big_buckets": ["--zero-stage", "3", "--reduce-bucket-size", "5e8", "--prefetch-bucket-size", "5e8",
                          "--param-persistence-threshold", "1e6"],
}


def make_shards(out: Path, frames: int, tokens_per_frame: int, samples: int) -> Path:
    """Square synthetic videos whose budgeted grid is [frames/2, 2*s, 2*s] with s*s = tokens_per_frame."""
    from scripts.synth_videos import VideoSpec, write_dataset

    shards = out / "shards"
    if (shards / "build.json").exists():
        return shards
    side = int(math.isqrt(tokens_per_frame))
    if side * side != tokens_per_frame:
        raise SystemExit(f"--tokens-per-frame must be a square number, got {tokens_per_frame}")
    px = side * 32  # 2 patches of 16 px per merged token side
    window = frames / 2.0  # sampled at 2 fps
    specs = [VideoSpec(name=f"bench_{i}", duration_s=window, fps=4, width=px, height=px,
                       events=((window * 0.25, window * 0.6),), seed=i) for i in range(samples)]
    videos = write_dataset(out / "videos", specs)
    cmd = [sys.executable, "-m", "prep", "build", "--videos", str(videos), "--out", str(shards),
           "--window-seconds", str(window), "--video-max-tokens", str(tokens_per_frame),
           "--video-min-tokens", str(min(128, tokens_per_frame)), "--no-progress"]
    subprocess.run(cmd, check=True)
    return shards


def make_model(out: Path, size: str) -> Path:
    import torch

    from train.models import create_random_model

    model = out / f"model_{size}"
    if not (model / "config.json").exists():
        create_random_model(size, model, dtype=torch.bfloat16)
    return model


def step_stats(run: Path) -> dict:
    steps = [json.loads(line) for f in sorted((run / "logs").glob("rank*.jsonl")) for line in open(f)]
    steps = [s for s in steps if s.get("event") == "step"]
    by_rank = {}
    for s in steps:
        by_rank.setdefault(s["rank"], []).append(s)
    secs = [s["seconds"] for s in by_rank.get(0, [])[1:]]
    return {
        "steps": len(by_rank.get(0, [])),
        "step_s_median": round(statistics.median(secs), 3) if secs else None,
        "step_s_all": [round(x, 3) for x in secs],
        "input_tokens": by_rank[0][0]["input_tokens"] if by_rank else None,
        "peak_alloc_gib": {r: max(s["peak_alloc_gib"] for s in v) for r, v in by_rank.items()},
        "peak_reserved_gib": {r: max(s["peak_reserved_gib"] for s in v) for r, v in by_rank.items()},
        "loss_last": by_rank[0][-1]["loss"] if by_rank else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="qwen3_vl_4b", help="a shape in train/configs")
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--tokens-per-frame", type=int, default=196)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", default="plain,zero3,zero2", help=f"comma list of {sorted(MODES)}")
    ap.add_argument("--anchor", type=Path, help="also run this plain-stack script (torchrun) for comparison")
    ap.add_argument("--out", type=Path, default=Path("bench_train_out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    shards = make_shards(args.out, args.frames, args.tokens_per_frame, samples=args.nproc)
    model = make_model(args.out, args.size)
    print(f"data + model ready in {time.time() - t0:.0f}s", flush=True)
    results = {}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
    for mode in args.modes.split(","):
        run = args.out / f"run_{mode}"
        cmd = torchrun + ["-m", "train.main", "--shards", str(shards), "--output-dir", str(run), "--model", str(model),
                          "--max-steps", str(args.steps), "--tail", "pad", "--dtype", "bf16", "--save-every", "0",
                          *MODES[mode]]
        t1 = time.time()
        with open(args.out / f"{mode}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        results[mode] = {"rc": rc, "wall_s": round(time.time() - t1, 1), **(step_stats(run) if rc == 0 else {})}
        print(json.dumps({"mode": mode, **results[mode]}), flush=True)
    if args.anchor:
        cmd = torchrun + [str(args.anchor), "--size", args.size.split("_")[-1], "--frames", str(args.frames),
                          "--tokens-per-frame", str(args.tokens_per_frame), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        (args.out / "anchor.log").write_text(out.stdout + out.stderr)
        lines = [json.loads(l[7:]) for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        results["anchor"] = {"rc": out.returncode, "ranks": lines}
        print(json.dumps({"mode": "anchor", **results["anchor"]}), flush=True)
    base = results.get("plain", {}).get("step_s_median")
    for mode, r in results.items():
        if base and r.get("step_s_median"):
            r["speedup_vs_plain"] = round(base / r["step_s_median"], 2)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "results": results}, indent=1))
    print("| mode | step s (median) | speedup vs plain | peak alloc GiB (rank 0) | peak reserved GiB (rank 0) |")
    print("| --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        if mode == "anchor":
            rk = (r.get("ranks") or [{}])[0]
            print(f"| anchor script | {rk.get('step_s_median')} | | {rk.get('peak_alloc_gib')} | {rk.get('peak_reserved_gib')} |")
        else:
            print(f"| {mode} | {r.get('step_s_median')} | {r.get('speedup_vs_plain', '')} | "
                  f"{r.get('peak_alloc_gib', {}).get(0)} | {r.get('peak_reserved_gib', {}).get(0)} |")


if __name__ == "__main__":
    main()
