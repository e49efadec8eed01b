"""Memory planner: peak GPU memory per phase of one rank for the heaviest micro-batch of a run, and the
fastest configuration that fits a given card.

The prediction is a sum of named parts, each counted from the model's shape (train/shapes.py) and the
micro-batch (tokens, supervised positions, vision patches), in bytes:

- weights: the frozen base in bf16 on every rank (ZeRO 0-2), a 1/world partition plus the gather window
  under ZeRO-3 (its largest tensor, the embedding, gathered whole, plus two prefetch buckets, at most
  stage3_max_live_parameters), only the gather
  window with parameter offload; the language model's linear weights at 0.53 (nf4) / 1.0 (int8) bytes with
  --quantize-base.
- trainable: bf16 parameters and gradients, fp32 gradient partition, fp32 master + Adam moments (12 bytes)
  partitioned over ranks by the ZeRO stage (optimizer from stage 1, gradients from 2, parameters at 3) or on
  the host with optimizer offload.
- boundaries: the input of every checkpointed decoder layer ([tokens, hidden] in bf16), counted on the device
  also with --offload-activations: on one H200 (session 5) its 128-frame 12 GiB leg ran out of memory in the
  first forward holding ~2.3 GB more than predicted, about what the boundaries take, while on CPU no layer
  input is saved (tests/test_levers.py); until a GPU shows the saving, the planner does not count it and
  auto does not offer the flag; kept: every activation a non-checkpointed layer saves for backward.
- layer activations (what one decoder layer saves for backward, per token) are enumerated tensor by tensor
  in `layer_bytes_per_token`: norms in fp32, the projections' shared input, one dropout output + mask per
  LoRA-targeted projection (lora_dropout > 0, unless train/lora_dropout.py draws it again in backward: then
  what LoRA without dropout keeps), q/k norms in fp32 (rotary keeps only cos/sin), sdpa's q, k, v and
  output, the output gate (Qwen3.5), the MLP's gate/up/act/product and the linear-attention layers' conv
  and recurrent-state tensors. Backward recomputes one checkpointed layer at a time: its activations plus
  one [tokens, intermediate] gradient are the working set.
- head: the loss. Full logits (the plain stack): 12 bytes per (position, vocab) entry at the start of
  backward (bf16 logits, fp32 log-softmax output, fp32 gradients of both), 14 when the caller holds the
  model outputs through backward (as the anchor script does); at supervised positions only (torch) the same
  per supervised position; chunked: one chunk of 1024 positions.
- vision: the frozen tower's transient per patch of one chunk (residual, fc1 + activation, fp32 q/k for
  the rotary) and the merged + deepstack features handed to the language model.

Phases: forward = weights + trainable + max(vision, boundaries + kept + head's forward part); backward =
weights + trainable + boundaries + kept + max(head, working set); optimizer step = weights + trainable +
fp32 temporaries. No coefficient is fitted; one modelling choice was made after comparing with the 4B
64-512 frame sweep (one [tokens, intermediate] gradient in the working set, not the MLP's three).
tests/test_memplan.py checks every prediction against the peaks measured on H200s (issue 9's table and
BENCHMARKS.md: 18 runs, 4B/8B/Qwen3.5-9B shapes, ZeRO-2/3, 1 and 2 GPUs, 64-512 frames, plain and
supervised-only loss, 4 runs with the shipping levers, with and without checkpointing, and 17 per-phase peaks)
within 15% (all within 9%). Two modelling choices were made after session 4's H200 runs, both from what
autograd keeps, not fitted: rotary keeps no per-token tensor, and with LoRA dropout a frozen projection's
input is not kept (only the dropout outputs are). Qwen3.5's linear attention is counted per kernel: the
torch fallback's tensors as measured in session 4, fla's from its autograd function's saved tensors (one H200,
Qwen3.5-9B at 64 frames: 83.91 GiB measured, 83.57 predicted; it had been +21% with the fallback's count). Known miss (BENCHMARKS.md "One H200"): the offload
configurations (-14% / -35%, measured before --offload-activations really offloaded).

`choose` walks the candidates fastest first (ZeRO-2 without checkpointing > ZeRO-2 > ZeRO-3 > +activation
offload > +optimizer offload > +parameter offload; a quantized base only when asked for, since it changes
the model), returns the first whose predicted peak fits the card with `HEADROOM`, and, where that one
checkpoints every layer, leaves the last N layers un-checkpointed for the largest N that still fits.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from train.activations import Checkpointing
from train.config import keeps_parameters_whole, own_zero3_settings
from train.flops import layer_forward_flops
from train.adamw import applies as plain_adamw_applies, switched_on as plain_adamw_switched_on
from train.lora_dropout import (applies as lora_dropout_recomputed, keeps_product_inputs,
                                switched_on as lora_dropout_switched_on)
from train.shapes import LayerShape, ModelShape

GIB = 2**30
HEADROOM = 0.95  # fits when the predicted peak <= 95% of the card (allocator fragmentation, CUDA context)
MAX_LIVE = 1e8  # elements: stage3_max_live_parameters of the default DeepSpeed config
QUANT_BYTES = {"nf4": 0.53, "int8": 1.0}  # bytes per quantized weight, scales included
LOSS_CHUNK = 1024  # supervised positions per chunk (train.loss.LossSpec.chunk_positions)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The micro-batch the plan is made for (the heaviest of the run)."""

    tokens: int  # positions the language model runs: rows x row length (padding included)
    supervised: int  # positions with a loss
    patches: int  # vision-tower patch rows (merge^2 per visual token)
    visual_tokens: int
    patches_per_group: int  # patch rows of the largest temporal group (h x w)
    sample_ids: tuple[str, ...] = ()

    @classmethod
    def synthetic(cls, *, frames: int, tokens_per_group: int, input_tokens: int, supervised: int,
                  merge: int = 2) -> "Workload":
        """A bench-style window: frames/2 temporal groups of tokens_per_group merged tokens each."""
        groups = frames // 2
        visual = groups * tokens_per_group
        return cls(tokens=input_tokens, supervised=supervised, patches=visual * merge * merge, visual_tokens=visual,
                   patches_per_group=tokens_per_group * merge * merge)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """One configuration of the trainer, as far as memory goes."""

    zero_stage: int
    checkpointing: str = "all"  # all | none | every-K
    offload_activations: bool = False
    keep_attention: bool = False  # --no-recompute-attention: checkpointed layers keep their sdpa outputs
    quantize_base: str | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    prefetch_bucket: float = 5e6  # stage3_prefetch_bucket_size (elements)
    loss: str = "chunked"  # model (full logits) | torch | chunked | liger
    vision_chunk_frames: int = 64  # 0: the whole micro-batch in one pass
    finetune: str = "lora"
    lora_r: int = 8
    lora_dropout: bool = True  # dropout > 0 saves a copy of each LoRA input
    recompute_lora_dropout: bool = True  # ... unless it is drawn again in backward (train/lora_dropout.py)
    recompute_mlp_product: bool = True  # ... and then, where layers are checkpointed, the down projection's
    # branch keeps SwiGLU's gate and up, not their product (False: measured before that, train/lora_dropout.py)
    keeps_outputs: bool = False  # the caller holds the model outputs (logits) through backward
    fused_kernels: bool = False  # liger's RMSNorm / SwiGLU (train/kernels.py): bf16 norm inputs, no MLP act copy
    linear_attention: str = "torch"  # Qwen3.5's gated-delta-rule kernel: fla | torch (what it saves differs)
    own_zero3: bool = True  # ZeRO-3's persistence left to train.main (train.config.own_zero3_settings)
    plain_adamw: bool = True  # stage 0 steps the trainer's AdamW (train/adamw.py): on one GPU stage 0 replaces 2
    exact: bool = True  # computes the same loss as the reference (a quantized base does not)

    def name(self) -> str:
        parts = [f"zero{self.zero_stage}", f"ckpt-{self.checkpointing}"]
        parts += [x for x, on in (("keep-attn", self.keep_attention), ("offload-act", self.offload_activations),
                                  ("offload-opt", self.offload_optimizer),
                                  ("offload-param", self.offload_params)) if on]
        if self.quantize_base:
            parts.append(self.quantize_base)
        return "+".join(parts)

    def flags(self) -> list[str]:
        """train.main flags that select this configuration."""
        out = ["--zero-stage", str(self.zero_stage), "--gradient-checkpointing", self.checkpointing]
        out += [f for f, on in (("--no-recompute-attention", self.keep_attention),
                                ("--offload-activations", self.offload_activations),
                                ("--offload-optimizer", self.offload_optimizer),
                                ("--offload-params", self.offload_params)) if on]
        if self.quantize_base:
            out += ["--quantize-base", self.quantize_base]
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    setup: Setup
    phases: dict  # phase -> GiB (load, forward, backward, optimizer_step)
    parts: dict  # part -> GiB (what the peak is made of)

    @property
    def peak_gib(self) -> float:
        return max(self.phases.values())

    def to_json(self) -> dict:
        return {"setup": self.setup.name(), "flags": self.setup.flags(), "exact": self.setup.exact,
                "peak_gib": round(self.peak_gib, 2), "phases_gib": {k: round(v, 2) for k, v in self.phases.items()},
                "parts_gib": {k: round(v, 3) for k, v in self.parts.items()}}


def layer_bytes_per_token(layer: LayerShape, shape: ModelShape, *, lora_dropout: bool, act: int = 2,
                          fused: bool = False, linear_kernel: str = "torch", zero3: bool = False,
                          product: bool = True) -> float:
    """Bytes one decoder layer saves for backward per token (bf16 activations, fp32 where the code upcasts).
    `fused` (liger's kernels): an RMSNorm keeps its bf16 input (and one fp32 rstd per row) instead of an fp32
    copy, SwiGLU keeps gate and up and recomputes the activation (one H200, 4B at 64 frames without
    checkpointing: 54.61 -> 44.74 GiB measured, this counts 40 of the 43 KB per token and layer).
    `linear_kernel`: what Qwen3.5's gated-delta-rule layers run (fla or transformers' torch fallback).
    `zero3`: DeepSpeed's ZeRO-3 runs every linear through LinearFunctionForZeroStage3, which saves its input
    whether the weight trains or not (its memory-efficient linear, on by default), so a frozen base keeps the
    projections' inputs too (one H200, 4B at 128 frames under a 12 GiB cap, three layers not checkpointed:
    the OOM report's allocation sites held ~2.43 GiB a layer where this counted 1.96 without it). Turning it off
    (torch's F.linear) is no lever where parameters are released: autograd then saves a view of the gathered
    weight, which outlives ZeRO-3's release of it (2 CPU ranks, partitioned, one layer not checkpointed: 442 KB
    of weights held, 12 KB of inputs freed). Where nothing is released (one rank, every parameter whole),
    train.config turns it off and `predict` passes zero3=False."""
    H, I = shape.hidden, shape.intermediate
    f32 = act if fused else 4  # what a norm keeps per element
    lora = sum(n * w for w, n in layer.lora_inputs.items()) * (act + 1) if lora_dropout else 0  # output + mask
    # A projection's input is kept by whatever needs it for a weight gradient: the LoRA A matrix (no dropout)
    # or a trainable base weight. With LoRA dropout only the dropout outputs (above) are kept: the frozen
    # base needs no input, so the norms' bf16 outputs and the MLP's product go once the layer has run.
    shared = 0 if lora_dropout and not zero3 else act
    # norm, input, gate / act / up, and the product (the down projection's input) unless its LoRA branch keeps
    # gate and up instead (`product` False: train/lora_dropout.py keeps_product_inputs)
    mlp = f32 * H + shared * H + (2 if fused else 3) * act * I + (shared * I if product else 0)
    if layer.kind == "full_attention":
        q, kv = layer.q, layer.kv
        mixer = (f32 * H + shared * H  # input norm (fp32) and the q/k/v projections' shared input
                 + f32 * (q + kv)  # q_norm / k_norm (fp32 unfused)
                 # rotary saves nothing per token: q*cos + rotate_half(q)*sin keeps only cos/sin for backward
                 # (counting q, k and their halves here over-predicted the 4B ckpt-none peak by 17%, H200)
                 + act * (q + 2 * kv) + act * q  # sdpa: q, k, v and its output (the o_proj input)
                 + 2 * act * layer.gate)  # Qwen3.5 output gate and its sigmoid
    else:
        C, Vd = layer.conv, layer.value
        k = (C - Vd) // 2  # query = key width
        if linear_kernel == "fla":
            # fla 0.6's ChunkGatedDeltaRuleFunction.save_for_backward: q and k l2-normalized in bf16 (their
            # per-head rstd is negligible), v as the conv output it is a view of, the gate cumsum and beta per
            # head, the [64]-wide intra-chunk matrix A per value head (bf16, k's dtype); its output in bf16
            recurrence = 2 * act * k + act * 64 * layer.v_heads + (f32 + 2 * act) * layer.v_heads + act * Vd
        else:  # transformers' torch fallback
            recurrence = (2 * 2 * f32 * k + f32 * Vd  # q, k l2-normalized in fp32 (input and output), v in fp32
                          + 4 * f32 * 64 * layer.v_heads  # chunked intra-chunk matrices (chunk 64) per value head
                          + 3 * f32 * Vd  # new values, key/value updates
                          + f32 * Vd)  # core output in fp32
        mixer = (f32 * H + shared * H  # input norm, projections' input
                 + 3 * act * C  # conv input, conv output, silu output
                 + recurrence
                 + act * Vd + 2 * f32 * Vd + act * Vd)  # z, gated norm, out_proj input
    return mixer + mlp + lora


def _trainable_params(shape: ModelShape, setup: Setup) -> int:
    if setup.finetune == "lora":
        return shape.lora_params(setup.lora_r)
    return shape.params_total - shape.params_vision


def predict(shape: ModelShape, work: Workload, setup: Setup, *, world: int = 1, act: int = 2) -> Prediction:
    """Peak GiB per phase of one rank (see the module docstring for every part)."""
    T, S = work.tokens, work.supervised
    n_train = _trainable_params(shape, setup)
    frozen = shape.params_total - (0 if setup.finetune == "lora" else n_train)
    weights = frozen * act
    if setup.quantize_base:
        quantized = shape.linear_params if setup.finetune == "lora" else 0
        weights -= quantized * (act - QUANT_BYTES[setup.quantize_base])
    stage = setup.zero_stage
    # ZeRO-3 gathers one unit whole (the embedding, or a leaf decoder layer: train/zero.py) plus the prefetch
    gathered = max(shape.largest_param, max(layer.params for layer in shape.layers))
    window = act * (gathered + min(2 * setup.prefetch_bucket, MAX_LIVE)) if stage == 3 else 0
    if stage == 3:
        weights = (0 if setup.offload_params else weights / world) + window
    # trainable: bf16 param + bf16 grad buffer, fp32 grad partition, fp32 master + Adam m, v
    w_opt = world if stage >= 1 else 1
    w_grad = world if stage >= 2 else 1
    w_param = world if stage == 3 else 1
    host_opt = setup.offload_optimizer
    trainable = n_train * (act / w_param + act + (0 if host_opt else 4 / w_grad + 12 / w_opt))

    spec = Checkpointing.parse(setup.checkpointing)
    ckpt = set(spec.layers(len(shape.layers)))
    # where ZeRO-3 keeps every parameter whole, DeepSpeed's memory-efficient linear is off: frozen inputs go
    zero3_linear = stage == 3 and not keeps_parameters_whole(world_size=world, offload_params=setup.offload_params,
                                                             own_zero3=setup.own_zero3)
    # LoRA dropout drawn again in backward keeps what LoRA without dropout keeps
    lora = setup.finetune == "lora"
    recomputed = lora_dropout_recomputed(
        lora=lora, lora_dropout=float(setup.lora_dropout), zero_stage=stage, quantized=bool(setup.quantize_base),
        enabled=setup.recompute_lora_dropout)
    dropout_kept = lora and setup.lora_dropout and not recomputed
    product = not (recomputed and setup.recompute_mlp_product and keeps_product_inputs(setup.checkpointing))
    per_layer = [layer_bytes_per_token(layer, shape, lora_dropout=dropout_kept,
                                       fused=setup.fused_kernels, linear_kernel=setup.linear_attention,
                                       zero3=zero3_linear, act=act, product=product) for layer in shape.layers]
    boundaries = len(ckpt) * T * shape.hidden * act  # also with offload_activations: measured (module docstring)
    if setup.keep_attention:  # the sdpa output (bf16) and its log-sum-exp (fp32 per head) of each full-attention one
        boundaries += sum(T * (act * layer.q + 4 * shape.heads) for i, layer in enumerate(shape.layers)
                          if i in ckpt and layer.kind == "full_attention")
    kept = sum(b * T for i, b in enumerate(per_layer) if i not in ckpt)
    grad = act * shape.intermediate * T  # the largest gradient alive beside the layer's saved tensors
    working = (max(per_layer[i] for i in ckpt) * T if ckpt else 0) + grad

    V = shape.vocab
    per_entry = 12 + (2 if setup.keeps_outputs else 0)
    head = {"model": T * V * per_entry, "torch": S * V * per_entry,
            "chunked": min(S, LOSS_CHUNK) * V * 12, "liger": min(S, LOSS_CHUNK) * V * 8}[setup.loss]
    head_forward = head * 10 / 12  # bf16 logits + fp32 copy + fp32 log-softmax output, before any gradient

    groups_per_chunk = setup.vision_chunk_frames // 2 if setup.vision_chunk_frames else 0
    chunk_patches = min(work.patches, groups_per_chunk * work.patches_per_group) if groups_per_chunk else work.patches
    Hv, Iv = shape.vision_hidden, shape.vision_intermediate
    vision_transient = chunk_patches * (act * (2 * Hv + 2 * Iv) + 4 * 2 * Hv)
    vision_out = work.visual_tokens * shape.vision_out * act * (1 + shape.deepstack)

    static = weights + trainable
    forward = static + max(vision_transient + vision_out, boundaries + kept + vision_out + head_forward)
    backward = static + boundaries + kept + max(head, working)
    optimizer = static + (0 if host_opt else 2 * 4 * n_train / w_opt)
    load = weights
    parts = {"weights": weights, "trainable": trainable, "boundaries": boundaries, "kept_layers": kept,
             "working_set": working, "head": head, "vision_transient": vision_transient, "vision_outputs": vision_out}
    phases = {"load": load, "forward": forward, "backward": backward, "optimizer_step": optimizer}
    return Prediction(setup=setup, phases={k: v / GIB for k, v in phases.items()},
                      parts={k: v / GIB for k, v in parts.items()})


def candidates(*, world: int, loss: str = "chunked", finetune: str = "lora", lora_r: int = 8, lora_dropout: bool = True,
               vision_chunk_frames: int = 64, quantize_base: str | None = None, zero_stage: int | None = None,
               checkpointing: str | None = None, offload_optimizer: bool = False,
               offload_params: bool = False, fused_kernels: bool = False,
               linear_attention: str = "torch", keep_attention: bool = False, own_zero3: bool = True,
               recompute_lora_dropout: bool = True, plain_adamw: bool = True) -> list[Setup]:
    """Configurations fastest first. Fixed choices (a given stage or checkpointing) narrow the list; a
    quantized base is included only when asked for (it changes the model, so auto never picks it alone)."""
    common = dict(loss=loss, finetune=finetune, lora_r=lora_r, lora_dropout=lora_dropout,
                  vision_chunk_frames=vision_chunk_frames, fused_kernels=fused_kernels,
                  linear_attention=linear_attention, own_zero3=own_zero3, recompute_lora_dropout=recompute_lora_dropout,
                  plain_adamw=plain_adamw)
    order: list[dict] = [dict(zero_stage=2, checkpointing="none"),
                         dict(zero_stage=2, checkpointing="all"), dict(zero_stage=3, checkpointing="all"),
                         dict(zero_stage=3, checkpointing="all", offload_optimizer=True),
                         dict(zero_stage=3, checkpointing="all", offload_optimizer=True, offload_params=True)]
    out = []
    for o in order:
        o = dict(o)
        if offload_optimizer:
            o["offload_optimizer"] = True
        if offload_params:
            o.update(zero_stage=3, offload_params=True)
        if quantize_base:
            if o["zero_stage"] == 3:
                continue  # bitsandbytes weights are not ZeRO-3 partitioned
            o["quantize_base"] = quantize_base
        if world == 1 and plain_adamw and o["zero_stage"] == 2 and not o.get("offload_optimizer"):
            # one rank: ZeRO-2 partitions nothing; stage 0 keeps the same bytes and steps the trainer's AdamW
            o["zero_stage"] = 0
        if zero_stage is not None and o["zero_stage"] != zero_stage:
            o["zero_stage"] = zero_stage
        if checkpointing is not None:
            o["checkpointing"] = checkpointing
            if checkpointing == "none":
                o.pop("offload_activations", None)
        if keep_attention and o["checkpointing"] != "none":
            o["keep_attention"] = True
        if world == 1 and o["zero_stage"] == 3 and not o.get("offload_params"):
            pass  # kept: on one GPU ZeRO-3 saves nothing but stays a valid (slower) choice
        setup = Setup(**o, **common, exact=not quantize_base)
        if setup not in out:
            out.append(setup)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """The planner's answer."""

    pick: Prediction
    fits: bool  # False: nothing fits; `pick` is the configuration with the smallest predicted peak
    gpu_mem_gib: float
    table: list  # [(Prediction, fits)] in candidate order
    workload: Workload

    def message(self) -> str:
        lines = [f"heaviest micro-batch: {self.workload.tokens} tokens ({self.workload.visual_tokens} visual, "
                 f"{self.workload.supervised} supervised, {self.workload.patches} vision patches)"
                 + (f": {', '.join(self.workload.sample_ids[:4])}" if self.workload.sample_ids else ""),
                 f"card: {self.gpu_mem_gib:.1f} GiB, usable {self.gpu_mem_gib * HEADROOM:.1f} GiB "
                 f"({HEADROOM:.0%} headroom rule)",
                 f"{'configuration':<44} {'load':>6} {'fwd':>6} {'bwd':>6} {'opt':>6} {'peak':>6}  fits"]
        for pred, ok in self.table:
            p = pred.phases
            lines.append(f"{pred.setup.name():<44} {p['load']:>6.1f} {p['forward']:>6.1f} {p['backward']:>6.1f} "
                         f"{p['optimizer_step']:>6.1f} {pred.peak_gib:>6.1f}  {'yes' if ok else 'no'}")
        verdict = "fastest that fits" if self.fits else "NOTHING FITS; smallest predicted peak"
        lines.append(f"pick ({verdict}): {self.pick.setup.name()}  ->  {' '.join(self.pick.setup.flags())}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"gpu_mem_gib": self.gpu_mem_gib, "headroom": HEADROOM, "fits": self.fits,
                "workload": dataclasses.asdict(self.workload), "pick": self.pick.to_json(),
                "candidates": [dict(p.to_json(), fits=ok) for p, ok in self.table]}


def choose(shape: ModelShape, work: Workload, *, gpu_mem_gib: float, world: int = 1,
           setups: Sequence[Setup] | None = None, refine_checkpointing: bool = True,
           decide_attention: bool = False) -> Choice:
    """The first (fastest) configuration whose predicted peak fits `gpu_mem_gib` x HEADROOM. A pick that
    checkpoints every layer is refined to all-but-N with the largest N that still fits (fewer recomputes),
    unless the checkpointing was fixed. `decide_attention`: a checkpointed pick is also tried with the
    attention outputs kept (then fewer layers fit whole), and the one whose backward recomputes fewer FLOPs
    wins (one H200, 4B at 512 frames in one call: kept + all-but-12 8.29 s against all-but-13 9.12 s)."""
    setups = list(setups) if setups is not None else candidates(world=world)
    budget = gpu_mem_gib * HEADROOM
    table = [(p, p.peak_gib <= budget) for p in (predict(shape, work, s, world=world) for s in setups)]
    for i, (pred, ok) in enumerate(table):
        if ok:
            options = [pred.setup]
            if decide_attention and pred.setup.checkpointing != "none" and not pred.setup.keep_attention:
                options.append(dataclasses.replace(pred.setup, keep_attention=True))
            refined = [p for p in (_refined(shape, work, s, world=world, budget=budget,
                                            refine=refine_checkpointing) for s in options) if p.peak_gib <= budget]
            best = min(refined, key=lambda p: recompute_flops(shape, work, p.setup))  # the first on a tie
            table[i:i] = [(p, True) for p in refined if p.setup != pred.setup]
            return Choice(pick=best, fits=True, gpu_mem_gib=gpu_mem_gib, table=table, workload=work)
    smallest = min((p for p, _ in table), key=lambda p: p.peak_gib)
    return Choice(pick=smallest, fits=False, gpu_mem_gib=gpu_mem_gib, table=table, workload=work)


def _refined(shape: ModelShape, work: Workload, setup: Setup, *, world: int, budget: float,
             refine: bool) -> Prediction:
    """`setup`'s prediction, every-layer checkpointing refined to all-but-N with the largest N that fits."""
    if refine and setup.checkpointing == "all":
        keep = _most_layers_kept(shape, work, setup, world=world, budget=budget)
        if keep:
            setup = dataclasses.replace(setup, checkpointing=f"all-but-{keep}")
    return predict(shape, work, setup, world=world)


def recompute_flops(shape: ModelShape, work: Workload, setup: Setup) -> float:
    """FLOPs the backward spends re-running the checkpointed layers' forwards (a kept attention output is
    not recomputed)."""
    total = 0.0
    for i in Checkpointing.parse(setup.checkpointing).layers(len(shape.layers)):
        linear, attention = layer_forward_flops(shape.layers[i], work.tokens)
        total += linear + (0.0 if setup.keep_attention else attention)
    return total


def _most_layers_kept(shape: ModelShape, work: Workload, setup: Setup, *, world: int, budget: float) -> int:
    """The largest N < layers for which all-but-N still fits (0 if none); memory grows with N."""
    lo, hi = 0, len(shape.layers) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        s = dataclasses.replace(setup, checkpointing=f"all-but-{mid}")
        if predict(shape, work, s, world=world).peak_gib <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def heaviest_workload(records, micro_batches, *, pack: bool, merge: int = 2) -> Workload:
    """The micro-batch of the plan with the most language-model tokens (padded rows, or one packed row)."""
    by_id = {r.sample_id: r for r in records}
    best = None
    for mb in micro_batches:
        rs = [by_id[s] for s in mb.sample_ids]
        tokens = sum(r.input_tokens for r in rs) if pack else max(r.input_tokens for r in rs) * len(rs)
        if best is None or tokens > best.tokens:
            best = Workload(tokens=tokens, supervised=sum(r.supervised_tokens for r in rs),
                            patches=sum(r.grid_t * r.grid_h * r.grid_w for r in rs),
                            visual_tokens=sum(r.visual_tokens for r in rs),
                            patches_per_group=max(r.grid_h * r.grid_w for r in rs), sample_ids=tuple(mb.sample_ids))
    if best is None:
        raise ValueError("the plan holds no micro-batch")
    return best


def memory_choice(cfg, model_config, records, plans, *, world: int, gpu_mem_gib: float):
    """(cfg with auto resolved, the Choice) for the heaviest micro-batch of `plans` on cards of `gpu_mem_gib`:
    what `--zero-stage auto` applies (train.main on CUDA) and what `python -m train.plan` prints, one path."""
    shape = ModelShape.from_config(model_config, lora_targets=cfg.lora_targets)
    work = heaviest_workload(records, [mb for p in plans for step in p.steps for rank in step for mb in rank],
                             pack=cfg.pack, merge=shape.merge)
    if cfg.sequence_parallel > 1:  # Ulysses: each rank of a group runs 1/sp of the sequence through the LLM
        sp = cfg.sequence_parallel
        work = dataclasses.replace(work, tokens=-(-work.tokens // sp), supervised=-(-work.supervised // sp))
    return auto_config(cfg, shape, work, world=world, gpu_mem_gib=gpu_mem_gib)


def cli(argv: list[str] | None = None) -> int:
    """python -m train.plan --model DIR --shards SHARDS --gpus N --gpu-mem GiB [--json] [train.main's flags]"""
    import argparse
    import sys
    from pathlib import Path

    from transformers import AutoConfig

    from schemas.manifest import SampleRecord, read_records
    from train.config import ConfigError, TrainConfig, build_parser
    from train.kernels import liger_kernels_default
    from train.models import detect_family
    from train.plan import PlanError, plan_run

    ap = argparse.ArgumentParser(
        prog="train.plan", parents=[build_parser()], add_help=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Predict the peak GPU memory per phase of a training run for its heaviest micro-batch and pick "
                    "the fastest configuration that fits: what train.main --zero-stage auto applies on CUDA, with "
                    "train.main's own flags and defaults (liger's kernels as train.main decides them on a CUDA card).")
    g = ap.add_argument_group("planner")
    g.add_argument("--gpus", type=int, default=1, help="ranks of the job (ZeRO partitions over them)")
    g.add_argument("--gpu-mem", type=float, required=True, help="GiB per GPU (the card, or a --mem-cap-gib)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    for action in ap._actions:  # a plan writes nothing: train.main's run directory is not needed here
        if action.dest == "output_dir":
            action.required, action.default, action.help = False, Path("."), argparse.SUPPRESS
    ns = vars(ap.parse_args(argv))
    gpus, gpu_mem, as_json = ns.pop("gpus"), ns.pop("gpu_mem"), ns.pop("json")
    ns.pop("local_rank", None)
    try:
        cfg = TrainConfig(**ns)
        cfg.validate()
        if cfg.model is None:
            raise ConfigError("train.plan needs --model DIR (its config.json is enough)")
        if gpus < 1 or gpus % cfg.sequence_parallel:
            raise ConfigError(f"--gpus {gpus}: give a positive multiple of --sequence-parallel {cfg.sequence_parallel}")
        if cfg.liger_kernels is None:
            cfg = dataclasses.replace(cfg, liger_kernels=liger_kernels_default(
                detect_family(cfg.model), compile=cfg.compile, device_type="cuda"))
        records = read_records(cfg.shards / "manifest.parquet", SampleRecord)
        plans = plan_run(records, cfg.plan_config(gpus // cfg.sequence_parallel), epochs=cfg.epochs,
                         max_steps=cfg.max_steps)
        _, choice = memory_choice(cfg, AutoConfig.from_pretrained(cfg.model), records, plans, world=gpus,
                                  gpu_mem_gib=gpu_mem)
    except (ConfigError, PlanError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(dict(choice.to_json(), liger_kernels=cfg.liger_kernels), indent=1))
    else:
        print(f"liger kernels: {'on' if cfg.liger_kernels else 'off'}\n{choice.message()}")
    return 0


def needs_auto(cfg) -> bool:
    """Whether a TrainConfig leaves the ZeRO stage or the checkpointing to the planner."""
    stage = 3 if cfg.preset else cfg.zero_stage
    return (stage is None and cfg.deepspeed is None) or cfg.gradient_checkpointing == "auto"


def without_gpu_figure(cfg):
    """Today's behaviour where there is no GPU memory to plan for (CPU, or a --deepspeed file decides):
    ZeRO-3 (a file's own stage stays the file's), every layer checkpointed, attention recomputed."""
    stage = 3 if cfg.preset else cfg.zero_stage
    if stage is None and cfg.deepspeed is None:
        stage = 3
    ckpt = "all" if cfg.gradient_checkpointing == "auto" else cfg.gradient_checkpointing
    recompute = True if cfg.recompute_attention is None else cfg.recompute_attention
    return dataclasses.replace(cfg, zero_stage=stage, gradient_checkpointing=ckpt, recompute_attention=recompute)


def config_levers(cfg: dict) -> dict:
    """The Setup fields a train.main config (its dict: run.json's or a TrainConfig's) decides beyond stage,
    checkpointing and offload. Qwen3.5's kernel is decided before planning (train.main routes it first); an
    undecided "auto" plans for the torch fallback, which keeps more."""
    return {"linear_attention": "fla" if cfg.get("linear_attention") == "fla" else "torch",
            "keep_attention": cfg.get("recompute_attention") is False, "own_zero3": own_zero3_settings(cfg),
            "recompute_lora_dropout": lora_dropout_switched_on(cfg),
            "plain_adamw": plain_adamw_applies(zero_stage=0, deepspeed_file=cfg.get("deepspeed") is not None,
                                               enabled=plain_adamw_switched_on(cfg))}  # what stage 0 would step


def auto_config(cfg, shape: ModelShape, work: Workload, *, world: int, gpu_mem_gib: float):
    """(cfg with the planner's pick applied, the Choice): the stage and checkpointing the flags leave to
    auto, plus any offload the pick needs; what the flags fix stays fixed (candidates narrowed to it)."""
    fixed_stage = 3 if cfg.preset else cfg.zero_stage
    auto_ckpt = cfg.gradient_checkpointing == "auto"
    # --loss-impl auto runs chunked except for a trainable lm_head under ZeRO-3 (train.loss.resolve_loss_impl),
    # which depends on the stage this picks: planned as chunked
    loss = "model" if cfg.full_logits else "chunked" if cfg.loss_impl == "auto" else cfg.loss_impl
    setups = candidates(world=world, loss=loss, finetune=cfg.finetune,
                        lora_r=cfg.lora_r, lora_dropout=cfg.lora_dropout > 0,
                        vision_chunk_frames=cfg.vision_chunk_frames, quantize_base=cfg.quantize_base,
                        zero_stage=fixed_stage, checkpointing=None if auto_ckpt else cfg.gradient_checkpointing,
                        offload_optimizer=cfg.offload_optimizer, offload_params=cfg.offload_params,
                        fused_kernels=cfg.liger_kernels is True,
                        # decided before planning (train.main routes the kernels first); "auto" undecided: the
                        # torch fallback, which keeps more
                        **config_levers(vars(cfg)))
    choice = choose(shape, work, gpu_mem_gib=gpu_mem_gib, world=world, setups=setups,
                    decide_attention=cfg.recompute_attention is None and cfg.attention == "sdpa")
    pick = choice.pick.setup
    resolved = dataclasses.replace(
        cfg, zero_stage=pick.zero_stage,
        recompute_attention=not pick.keep_attention if cfg.recompute_attention is None else cfg.recompute_attention,
        gradient_checkpointing=pick.checkpointing if auto_ckpt else cfg.gradient_checkpointing,
        offload_activations=cfg.offload_activations or pick.offload_activations,
        offload_optimizer=cfg.offload_optimizer or pick.offload_optimizer,
        offload_params=cfg.offload_params or pick.offload_params)
    return resolved, choice
