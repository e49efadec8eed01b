"""Causal attention alone, per sdpa backend, at the language model's shapes: which kernel a long window should get.

At 512 frames (~52.7k tokens) causal attention is most of a 4B step (train/flops.py counts it), and sdpa picks
its kernel itself. This times forward and forward + backward of `F.scaled_dot_product_attention(q, k, v,
is_causal=True)` with the model's query / key-value heads for each backend torch offers (cuDNN, flash,
memory-efficient; math only on CPU; `default`: sdpa's own pick, what the trainer gets), with grouped-query attention given to the kernel (`enable_gqa`, what
transformers passes) or with the key/value heads repeated first (`repeat_kv`), and checks each output and
gradient against the first backend that ran. A backend that refuses the shape is recorded with its error.

  python -m scripts.bench_attention --size qwen3_vl_4b --tokens 6617 52695 --out $OUT/attention.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def causal_tflop(tokens: int, heads: int, head_dim: int, *, backward: bool) -> float:
    """QK^T and PV over the causal half: 2 matmuls x 2 FLOPs x T^2/2 x heads x head_dim forward; backward 2x."""
    forward = 2 * tokens * tokens * heads * head_dim
    return forward * (3 if backward else 1) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(backend: str, gqa: str, q, k, v, *, repeats: int) -> dict:
    """Median seconds of forward and of forward + backward; the output and input gradients for the check."""
    groups = q.shape[1] // k.shape[1]
    fwd, both = [], []
    out = grads = None
    for _ in range(repeats + 1):  # the first is a warm-up
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        _sync(q.device)
        t0 = time.perf_counter()
        with sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] else contextlib.nullcontext():
            kk, vv = (k_, v_) if gqa == "enable_gqa" or groups == 1 else \
                (k_.repeat_interleave(groups, 1), v_.repeat_interleave(groups, 1))
            o = F.scaled_dot_product_attention(q_, kk, vv, is_causal=True, enable_gqa=gqa == "enable_gqa" and groups > 1)
            _sync(q.device)
            t1 = time.perf_counter()
            o.backward(torch.ones_like(o))
        _sync(q.device)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        both.append(t2 - t0)
        out, grads = o.detach(), (q_.grad, k_.grad, v_.grad)
    return {"forward_s": statistics.median(fwd[1:]), "forward_backward_s": statistics.median(both[1:]),
            "out": out, "grads": grads}


def run(*, heads: int, kv_heads: int, head_dim: int, tokens: list[int], device: torch.device, dtype: torch.dtype,
        repeats: int, backends: list[str]) -> list[dict]:
    rows = []
    for t in tokens:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, heads, t, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, kv_heads, t, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, kv_heads, t, head_dim, device=device, dtype=dtype, generator=gen)
        ref = None
        for backend in backends:
            for gqa in ("enable_gqa", "repeat_kv"):
                row = {"tokens": t, "backend": backend, "gqa": gqa}
                try:
                    r = time_case(backend, gqa, q, k, v, repeats=repeats)
                except RuntimeError as e:  # the backend refuses this shape, dtype or device
                    row["error"] = str(e).splitlines()[0][:200]
                    rows.append(row)
                    continue
                if ref is None:
                    ref = r
                row["max_rel_diff"] = max(
                    (a.float() - b.float()).abs().max().item() / (b.float().abs().max().item() or 1.0)
                    for a, b in zip((r["out"], *r["grads"]), (ref["out"], *ref["grads"])))
                row["forward_ms"] = round(r["forward_s"] * 1e3, 3)
                row["forward_backward_ms"] = round(r["forward_backward_s"] * 1e3, 3)
                row["forward_backward_tflops"] = round(
                    causal_tflop(t, heads, head_dim, backward=True) / r["forward_backward_s"], 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="qwen3_vl_4b", help="model shape file (train/configs/) for the head counts")
    ap.add_argument("--tokens", type=int, nargs="+", default=[6617, 52695], help="sequence lengths to time")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats after one warm-up (median reported)")
    ap.add_argument("--backends", nargs="+", default=None, choices=sorted(BACKENDS),
                    help="default: default cudnn flash efficient on CUDA, default math on CPU")
    ap.add_argument("--heads", type=int, nargs=3, metavar=("Q", "KV", "DIM"), default=None,
                    help="query heads, key/value heads, head dim (instead of --size)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.heads:
        heads, kv_heads, head_dim = a.heads
    else:
        from train.shapes import ModelShape

        shape = ModelShape.from_shape_file(a.size)
        layer = next(layer for layer in shape.layers if layer.kind == "full_attention")
        heads, head_dim = shape.heads, shape.head_dim
        kv_heads = layer.kv // head_dim
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backends = a.backends or (["default", "cudnn", "flash", "efficient"] if cuda else ["default", "math"])
    rows = run(heads=heads, kv_heads=kv_heads, head_dim=head_dim, tokens=a.tokens, device=device,
               dtype=torch.bfloat16 if cuda else torch.float32, repeats=a.repeats, backends=backends)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "cudnn": torch.backends.cudnn.version(), "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(json.dumps(env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
