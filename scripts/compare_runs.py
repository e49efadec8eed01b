"""Two train.main configurations at equal work, side by side: memory and time.

Equal work means the same samples per optimizer step (micro-batch x accumulation x ranks) and the same number
of steps over the same shards and model, e.g. micro 4 x accum 8 against micro 2 x accum 16: the question is
what the larger micro-batch costs in memory and buys in time. Each run is a separate train.main process
(scripts/bench_train.py's runner); printed: step seconds, samples/s, tokens/s, data-wait share, peak
allocated / reserved GiB per phase, the planner's prediction, and the last loss (equal work, same seed: the
losses should agree closely).

  python -m scripts.compare_runs --model DIR --shards SHARDS --steps 4 \\
      --a "--micro-batch-size 4 --grad-accum 8" --b "--micro-batch-size 2 --grad-accum 16" [--common "--zero-stage 2"]
  python -m scripts.compare_runs --size qwen3_vl_4b --frames 64 ...   # synthetic shards and a random model
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from scripts.bench_train import TOKENS_PER_GROUP, make_model, make_shards, run_logged, run_stats, train_command


def _samples_per_step(flags: list[str]) -> int:
    def value(name: str, default: int) -> int:
        return int(flags[flags.index(name) + 1]) if name in flags else default

    return value("--micro-batch-size", 1) * value("--grad-accum", 1)


def compare(a: dict, b: dict) -> str:
    rows = [("step s (median)", "step_s"), ("samples / s", "samples_per_s"), ("tokens / s", "tokens_per_s"),
            ("data wait share", "data_wait_share"), ("peak alloc GiB", "peak_alloc_gib"),
            ("peak reserved GiB", "peak_reserved_gib"), ("predicted peak GiB", "predicted_peak_gib"),
            ("last loss", "loss_last")]
    out = [f"{'':<28} {'A':>14} {'B':>14}", f"{'flags':<28} {' '.join(a['flags']):>14} | {' '.join(b['flags'])}"]
    for label, key in rows:
        out.append(f"{label:<28} {_fmt(a.get(key)):>14} {_fmt(b.get(key)):>14}")
    for phase in sorted(set(a.get("phase_memory", {})) | set(b.get("phase_memory", {}))):
        pa, pb = a.get("phase_memory", {}).get(phase, {}), b.get("phase_memory", {}).get(phase, {})
        out.append(f"{'  ' + phase + ' alloc/reserved':<28} "
                   f"{_fmt(pa.get('alloc_gib')) + '/' + _fmt(pa.get('reserved_gib')):>14} "
                   f"{_fmt(pb.get('alloc_gib')) + '/' + _fmt(pb.get('reserved_gib')):>14}")
    kind = a.get("memory_kind") or b.get("memory_kind")
    if kind == "cpu_rss":
        out.append("(CPU run: memory is the process RSS stand-in, not CUDA allocator peaks)")
    return "\n".join(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="train.main flags of configuration A (quoted)")
    ap.add_argument("--b", required=True, help="train.main flags of configuration B (quoted)")
    ap.add_argument("--common", default="", help="flags both runs get")
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: a random --size model)")
    ap.add_argument("--size", default="qwen3_vl_4b")
    ap.add_argument("--shards", type=Path, default=None, help="prep build output (default: synthetic --frames windows)")
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--samples", type=int, default=None, help="synthetic windows (default: one step's worth)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=1, help="ranks (0: one plain process, CPU)")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=Path("compare_runs_out"))
    args = ap.parse_args(argv)
    flags_a = shlex.split(args.common) + shlex.split(args.a)
    flags_b = shlex.split(args.common) + shlex.split(args.b)
    if _samples_per_step(flags_a) != _samples_per_step(flags_b):
        print(f"error: not equal work: A trains {_samples_per_step(flags_a)} samples per rank and step, B "
              f"{_samples_per_step(flags_b)} (micro-batch x accumulation must match)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    world = max(args.nproc, 1)
    shards = args.shards or make_shards(args.out, args.frames, TOKENS_PER_GROUP,
                                        args.samples or _samples_per_step(flags_a) * world)
    model = args.model or make_model(args.out, args.size)
    results = {}
    for name, flags in (("A", flags_a), ("B", flags_b)):
        run = args.out / f"run_{name}"
        cmd = train_command(flags=flags, shards=shards, run=run, model=model, steps=args.steps, nproc=args.nproc,
                            cap_gib=None, num_workers=args.num_workers)
        rc, wall = run_logged(cmd, args.out / f"{name}.log", args.timeout_s)
        stats = run_stats(run, model=model) if rc == 0 else run_stats(run)
        if stats.get("step_s"):
            stats["samples_per_s"] = round(_samples_per_step(flags) * world / stats["step_s"], 3)
        results[name] = {"rc": rc, "wall_s": wall, "flags": shlex.split(getattr(args, name.lower())), **stats}
        if rc != 0:
            print(f"error: run {name} exited {rc}; see {args.out / f'{name}.log'}", file=sys.stderr)
            return 1
    (args.out / "compare.json").write_text(json.dumps(results, indent=1))
    print(compare(results["A"], results["B"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
