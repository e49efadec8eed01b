"""The LoRA dropout gradient's masked add on one GPU: torch's addcmul (bool mask beside bf16) against
train.lora_dropout.add_masked_ (Triton), at the shapes of the 4B's projections' inputs; medians of CUDA-event
timings and how many bf16 results differ.

  python -m scripts.bench_masked_add --tokens 6617 52695 --width 2560 4096 9728 --out $OUT/masked_add.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from train.lora_dropout import add_masked_


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[6617, 52695])
    ap.add_argument("--width", type=int, nargs="+", default=[2560, 4096, 9728])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_masked_add: needs a CUDA GPU (the Triton kernel runs only there)")
    rows = []
    for t in a.tokens:
        for w in a.width:
            g = torch.Generator(device="cuda").manual_seed(0)
            out = torch.randn(t, w, device="cuda", dtype=torch.bfloat16, generator=g)
            value = torch.randn(t, w, device="cuda", dtype=torch.bfloat16, generator=g)
            mask = torch.rand(t, w, device="cuda", generator=g) > 0.05
            ref, got = out.clone(), out.clone()
            ref.addcmul_(value, mask, value=1 / 0.95)
            add_masked_(got, value, mask, 1 / 0.95)
            work = out.clone()
            row = {"tokens": t, "width": w,
                   "addcmul_ms": round(_time(lambda: work.addcmul_(value, mask, value=1 / 0.95), a.repeats), 3),
                   "add_masked_ms": round(_time(lambda: add_masked_(work, value, mask, 1 / 0.95), a.repeats), 3),
                   "differ": int((ref != got).sum()), "max_abs_diff": float((ref.float() - got.float()).abs().max())}
            row["speedup"] = round(row["addcmul_ms"] / row["add_masked_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                                    indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
