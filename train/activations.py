"""What the language model keeps for backward: activation checkpointing per decoder layer, and the saved
checkpoint inputs optionally held in host memory.

`--gradient-checkpointing all|none|every-K|all-but-N|auto`: `all` recomputes every decoder layer in backward
(keeps one [tokens, hidden] input per layer), `none` keeps every layer's activations (fastest, most memory),
`every-K` checkpoints layers 0, K, 2K, ..., `all-but-N` every layer except the last N, `auto` lets the memory
planner pick the least checkpointing that fits: none, else all-but-N with the largest N that fits, else all
(train/memplan.py; `all` where no GPU memory figure exists, e.g. on CPU).
The vision blocks are never checkpointed: a frozen tower runs without autograd (train/vision.py).

`--no-recompute-attention`: the checkpointed layers keep their attention's output (torch's selective
checkpointing saves what the sdpa op returns: output and log-sum-exp, ~q width x 2 bytes per token) and
recompute everything else in backward. Why: the recompute repeats each layer's forward, and at long
sequences causal attention is most of that forward (4B at 512 frames: ~23 of ~35 TFLOP per layer), while its
output costs 1.6x a layer input; so a long window recomputes the cheap part only, for memory far below a
layer kept whole (~43 KB per token with liger's kernels against ~13 KB). The sdpa implementation only
(eager attention has no single op to keep).

`--offload-activations`: each checkpointed layer's input (the one [tokens, hidden] tensor it keeps) is
copied to host memory before the layer runs, and the checkpoint holds only that host copy; the layer (and
its recompute in backward) gets a device copy made inside the checkpointed function, freed with the rest
of its activations. Costs one device-to-host copy per layer in the forward and one host-to-device copy in
the backward. Why not transformers' `offload=True` (torch.autograd.graph.save_on_cpu around the checkpoint):
a non-reentrant checkpoint keeps its inputs by reference, not through saved-tensor hooks, so nothing moved
(measured on one H200, 4B, 256 frames under a 12 GiB cap: forward peak 9.5 GiB against 2.0 predicted with
the inputs on the host: ~330 KB per token missing, of which the bf16 layer inputs staying on the device
are 184 KB; the rest is not explained yet).
"""
from __future__ import annotations

import dataclasses
import re

import torch

CHOICES = "auto|all|none|every-K|all-but-N"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Every `every`-th language-model decoder layer is checkpointed (0: none), except the last `keep`."""

    every: int  # 1 = all, 0 = none, K = layers 0, K, 2K, ...
    keep: int = 0  # all-but-N: the last N layers keep their activations (the planner's "only where needed")

    @classmethod
    def parse(cls, text: str) -> "Checkpointing":
        """all | none | every-K | all-but-N (auto is resolved by the planner before this)."""
        if text == "all":
            return cls(every=1)
        if text == "none":
            return cls(every=0)
        m = re.fullmatch(r"every-(\d+)", text)
        if m and int(m.group(1)) >= 1:
            return cls(every=int(m.group(1)))
        m = re.fullmatch(r"all-but-(\d+)", text)
        if m:
            return cls(every=1, keep=int(m.group(1)))
        raise ValueError(f"--gradient-checkpointing {text!r}: choose {CHOICES} (K >= 1)")

    def layers(self, n_layers: int) -> list[int]:
        """Indices of the checkpointed decoder layers."""
        if self.every == 0:
            return []
        return list(range(0, max(0, n_layers - self.keep), self.every))

    def name(self) -> str:
        if self.keep:
            return f"all-but-{self.keep}"
        return {0: "none", 1: "all"}.get(self.every, f"every-{self.every}")


def problem(text: str) -> str | None:
    if text == "auto":
        return None
    try:
        Checkpointing.parse(text)
    except ValueError as e:
        return str(e)
    return None


def decoder_layers(model) -> list:
    """The language model's decoder layers (both families: `model.language_model.layers`)."""
    from train.vision import inner_model

    return list(inner_model(model).language_model.layers)


SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _keep_attention(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: the sdpa kernels' outputs are saved, everything else is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(op, "__name__", "").split(".")[0]
    return CheckpointPolicy.MUST_SAVE if name in SDPA_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(model, spec: Checkpointing, *, offload: bool = False, keep_attention: bool = False) -> list[int]:
    """Enable checkpointing on the chosen decoder layers of a transformers model (before PEFT wraps it);
    returns the checkpointed layer indices. With `offload`, their saved inputs live in host memory; with
    `keep_attention`, their attention outputs stay saved (module docstring)."""
    if spec.every == 0:
        if offload:
            raise ValueError("--offload-activations offloads the checkpointed layers' inputs: it needs "
                             "--gradient-checkpointing other than none")
        return []
    kwargs: dict = {"use_reentrant": False}
    if keep_attention:
        import functools

        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_attention)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    layers = decoder_layers(model)
    chosen = set(spec.layers(len(layers)))
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i in chosen
        if offload and i in chosen:
            layer._gradient_checkpointing_func = checkpoint_from_host
    return sorted(chosen)


def checkpoint_from_host(function, *args, **kwargs):
    """transformers' checkpointing hook (called as func(layer_forward, hidden_states, ...)): a non-reentrant
    checkpoint that holds the hidden states only as a host copy (module docstring)."""
    from torch.utils.checkpoint import checkpoint

    if not args or not isinstance(args[0], torch.Tensor):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    device = args[0].device
    host = args[0].to("cpu", copy=True)  # tracked by autograd; its backward (a copy back) keeps no tensor

    def on_device(host_states, *rest, **kw):
        return function(host_states.to(device, non_blocking=True), *rest, **kw)

    return checkpoint(on_device, host, *args[1:], use_reentrant=False, **kwargs)
