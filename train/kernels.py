"""Which kernels the model runs: the attention implementation and Qwen3.5's linear-attention layers.

Attention (`--attention`): transformers' `attn_implementation`. `sdpa` (default) reaches the flash and
memory-efficient kernels of torch when no dense mask is passed; the trainer passes no attention mask for an
unpadded micro-batch (causal is then `is_causal`, no [L, L] tensor) and for packed rows the per-sample
position ids give transformers the sample boundaries (block mask for sdpa/eager, varlen for flash).
`flash_attention_2` needs the flash-attn package and CUDA; `eager` is the plain reference.

Fused kernels (`--liger-kernels`): liger-kernel's Triton RMSNorm, rotary embedding and SwiGLU in place of the
model's torch modules (the loss has its own switch, `--loss-impl liger`). CUDA only; the bench
(scripts/bench_train.py) compares each step's loss with the reference path.

Vision attention (`--batched-vision-attention`, on by default): transformers' sdpa path of the Qwen3-VL /
Qwen3.5 vision tower reads the segment lengths back to the host in every block and calls attention once per
temporal group (a 64-frame video: 32 groups x 24 blocks = 768 calls and 24 host syncs per forward, ~45 us of
host time each on one H200). The groups of one video all have the same size, so this runs one batched call
per block over equal-length segments (the same attention, each group attending only to itself) and reads the
lengths once per tower pass; unequal segments take transformers' own forward.

Linear attention (`--linear-attention`, Qwen3.5's gated-delta-rule and causal-conv1d layers): transformers
picks flash-linear-attention (`fla`) / `causal_conv1d` at import when they are importable and otherwise a
plain torch fallback (or kernels from the model hub, which offline clusters never reach). `torch` forces
the fallback; `fla` requires fla and checks it against the fallback on the device first (fla 0.6 with
Triton < 3.7.1 computes wrong gradients on Hopper); `auto` takes fla when it is importable, on CUDA, and
passes that check, else the fallback, and says which.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect

import torch

ATTENTIONS = ("sdpa", "eager", "flash_attention_2")
LINEAR_ATTENTION = ("auto", "fla", "torch")
# Module-level functions of transformers' Qwen3.5 modeling file that transformers binds to fla /
# causal_conv1d when importable (their torch bodies are reached through inspect.unwrap).
LINEAR_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")
PROBE_TOLERANCE = 2e-2  # max |fla - torch| / max |torch|, forward output and input gradients, bf16


class KernelError(ValueError):
    """A kernel that was asked for cannot run here; the message says why and what to use instead."""


def attention_problem(name: str, device_type: str) -> str | None:
    """Why `--attention name` cannot run on this device, or None."""
    if name not in ATTENTIONS:
        return f"--attention {name!r}: choose one of {'|'.join(ATTENTIONS)}"
    if name == "flash_attention_2":
        if device_type != "cuda":
            return "--attention flash_attention_2 needs a CUDA device (use sdpa: torch's own flash kernel)"
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            return ("--attention flash_attention_2: the flash-attn package (>= 2.3.3) is not importable here; "
                    "use --attention sdpa")
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttentionChoice:
    """What Qwen3.5's linear-attention layers run, and why."""

    implementation: str  # "fla" or "torch"
    reason: str


def fla_importable() -> bool:
    return importlib.util.find_spec("fla") is not None


def _modeling_qwen3_5():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def force_torch_linear_attention() -> list[str]:
    """Bind Qwen3.5's linear-attention functions to their plain torch bodies; returns the names rebound."""
    mod = _modeling_qwen3_5()
    changed = []
    for name in LINEAR_FUNCTIONS:
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        body = inspect.unwrap(fn)
        if body is not fn:
            setattr(mod, name, body)
            changed.append(name)
    return changed


def probe_gated_delta_rule(candidate, reference, device: torch.device, *, seed: int = 0,
                           tolerance: float = PROBE_TOLERANCE) -> tuple[bool, float]:
    """Run both gated-delta-rule implementations forward and backward on one small random problem on `device`
    and compare (output and the q, k, v gradients). Returns (within tolerance, worst relative error)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, K, V = 1, 192, 2, 64, 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def inputs():
        q = torch.randn(B, T, H, K, generator=g)
        k = torch.randn(B, T, H, K, generator=g)
        v = torch.randn(B, T, H, V, generator=g)
        gate = -torch.rand(B, T, H, generator=g)  # log decay <= 0
        beta = torch.rand(B, T, H, generator=g)
        return [t.to(device, dtype) for t in (q, k, v)] + [gate.to(device, torch.float32), beta.to(device, dtype)]

    base = inputs()
    results = []
    for fn in (candidate, reference):
        q, k, v, gate, beta = [t.clone().requires_grad_(i < 3) for i, t in enumerate(base)]
        out, _ = fn(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
        out.float().square().sum().backward()
        results.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
    worst = 0.0
    for a, b in zip(*results):
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item())
    return worst <= tolerance, worst


def route_linear_attention(mode: str, device: torch.device) -> LinearAttentionChoice:
    """Make Qwen3.5's linear-attention layers run `mode` (auto|fla|torch) on `device`; KernelError when `fla`
    was asked for and cannot run correctly here."""
    if mode not in LINEAR_ATTENTION:
        raise KernelError(f"--linear-attention {mode!r}: choose one of {'|'.join(LINEAR_ATTENTION)}")
    if mode == "torch":
        force_torch_linear_attention()
        return LinearAttentionChoice(implementation="torch", reason="--linear-attention torch")
    why_not = None
    if device.type != "cuda":
        why_not = "flash-linear-attention is Triton code and needs a CUDA device"
    elif not fla_importable():
        why_not = "flash-linear-attention (fla) is not importable here (pip install flash-linear-attention)"
    else:
        mod = _modeling_qwen3_5()
        fn = mod.torch_chunk_gated_delta_rule
        try:
            ok, worst = probe_gated_delta_rule(fn, inspect.unwrap(fn), device)
        except Exception as e:  # fla refusing this Triton/GPU pair (fla 0.6 raises on Hopper below Triton 3.7.1)
            ok, worst = False, None
            why_not = f"fla raised {type(e).__name__}: {str(e)[:300]}"
        if not ok and why_not is None:
            why_not = (f"fla's chunk_gated_delta_rule differs from the torch reference by {worst:.3g} (relative, "
                       f"tolerance {PROBE_TOLERANCE}) on this device: check the Triton version (fla 0.6 needs "
                       "Triton >= 3.7.1 on Hopper) or install tilelang")
    if why_not is not None:
        if mode == "fla":
            raise KernelError(f"--linear-attention fla: {why_not}; use --linear-attention torch")
        force_torch_linear_attention()
        return LinearAttentionChoice(implementation="torch", reason=why_not)
    return LinearAttentionChoice(implementation="fla", reason="fla importable and within tolerance of the torch "
                                 "reference on this device")


def liger_kernels_problem(device_type: str) -> str | None:
    """Why `--liger-kernels` cannot run here, or None."""
    if device_type != "cuda":
        return "--liger-kernels needs a CUDA device (liger-kernel is Triton code)"
    if importlib.util.find_spec("liger_kernel") is None:
        return "--liger-kernels: liger-kernel is not importable here (pip install liger-kernel)"
    return None


def liger_kernels_default(family: str, *, compile: bool, device_type: str) -> bool:
    """`--liger-kernels` unset: on where measured to keep the loss and runnable, off with --compile. Measured on
    one H200 at 64 frames: Qwen3-VL-4B 1.13x, losses within 1e-3; Qwen3.5-9B (fla) 0.853 -> 0.763 s, 1.12x,
    losses within 3.2e-3 over 5 steps (liger >= 0.8.0 has its entry point). One rule for train.main and train.plan."""
    if compile or family not in ("qwen3_vl", "qwen3_5") or liger_kernels_problem(device_type) is not None:
        return False
    if family == "qwen3_5":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5  # noqa: F401
        except ImportError:
            return False  # an older liger: the default stays off rather than failing the run
    return True


def apply_liger_kernels(model, family: str) -> list[str]:
    """Swap the language model's RMSNorm, rotary embedding and SwiGLU MLP forward for liger's fused kernels, in
    place, before LoRA wraps the projections (the MLP keeps its Linear submodules, so adapters still apply).
    Returns what was swapped. Qwen3-VL is patched module by module from liger's building blocks (liger 0.8.5's
    own Qwen3-VL entry point fails to import its output classes); Qwen3.5 through liger's entry point (no
    rotary kernel for its hybrid layers)."""
    import types

    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if family == "qwen3_5":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5

            apply_liger_kernel_to_qwen3_5(rope=False, rms_norm=True, swiglu=True, cross_entropy=False,
                                          fused_linear_cross_entropy=False, model=base)
        except ImportError as e:
            raise KernelError(f"--liger-kernels: liger's Qwen3.5 patches do not import here: {e}") from None
        return ["rms_norm", "swiglu"]
    if family != "qwen3_vl":
        raise KernelError(f"--liger-kernels: no kernels for model family {family!r}")
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    text = [(n, m) for n, m in base.named_modules() if "visual" not in n]
    norms = [m for _, m in text if type(m).__name__ == "Qwen3VLTextRMSNorm"]
    for norm in norms:  # x * rsqrt(mean(x^2) + eps) in fp32, times the weight in the input dtype: liger's "llama"
        norm.offset, norm.casting_mode, norm.in_place, norm.row_mode = 0.0, "llama", True, None
        norm.forward = types.MethodType(LigerRMSNorm.forward, norm)
    mlps = [m for n, m in text if n.endswith(".mlp") and all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj"))]
    for mlp in mlps:  # down(silu(gate(x)) * up(x)) with silu * up fused
        mlp.forward = types.MethodType(LigerSwiGLUMLP.forward, mlp)
    modeling_qwen3_vl.apply_rotary_pos_emb = liger_rotary_pos_emb  # the text attention's rotary (process-wide)
    return [f"rms_norm x{len(norms)}", f"swiglu x{len(mlps)}", "rope"]


def batch_vision_attention(model) -> int:
    """`--batched-vision-attention`: give every sdpa vision-attention module of `model` the batched forward
    (module docstring); returns the modules changed."""
    import types

    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if (name.endswith("VisionAttention") and all(hasattr(module, k) for k in ("qkv", "proj", "num_heads", "scaling"))
                and getattr(module.config, "_attn_implementation", None) == "sdpa"):
            module.forward = types.MethodType(_segment_batched_attention, module)
            changed += 1
    return changed


def segment_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """The attention segments' lengths, read to the host once per tensor (the tower passes the same
    `cu_seqlens` to every block)."""
    lengths = getattr(cu_seqlens, "_segment_lengths", None)
    if lengths is None:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        cu_seqlens._segment_lengths = lengths
    return lengths


def _segment_batched_attention(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
    """One vision block's attention over equal-length segments as one batched sdpa call (no mask, not causal,
    no dropout: the tower's attention_dropout is 0); anything else goes to the class's own forward."""
    import sys

    lengths = segment_lengths(cu_seqlens)
    if len(set(lengths)) != 1 or getattr(self, "attention_dropout", 0.0):
        return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings=position_embeddings, **kwargs)
    rows, segments = hidden_states.shape[0], len(lengths)
    q, k, v = self.qkv(hidden_states).reshape(rows, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k, v = (t.reshape(segments, lengths[0], self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scaling)  # [segments, heads, len, dim]
    return self.proj(out.transpose(1, 2).reshape(rows, -1))


def compile_layers(model, backend: str = "inductor") -> int:
    """`--compile`: torch.compile each language-model decoder layer in place (regional compilation: the
    layers share one compiled graph, plus one for the first layer, whose input needs no gradient), after LoRA
    and checkpointing are set up so both are inside the graph. Fuses the elementwise work between the matmuls
    (norms, rotary, SwiGLU, LoRA scaling, residuals) and cuts kernel launches. Returns the layers compiled.

    transformers >= 5.25 requires the `kernels` package, whose wrapper around each attention forward sets and
    resets a context variable (which rotary function is active). Under activation checkpointing dynamo refuses
    to trace a side effect it cannot replay in the recomputed forward and ran the whole layer eager; this one
    needs no replay (set and reset within the call, read only inside it), so the layers are traced with
    forward side effects not replayed in backward (tests/test_levers.py compares loss and gradients)."""
    import torch._dynamo

    from train.activations import decoder_layers

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    layers = decoder_layers(model.get_base_model() if hasattr(model, "get_base_model") else model)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
