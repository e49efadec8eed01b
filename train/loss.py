"""The training loss: mean cross-entropy over the supervised positions (the answer and its <|im_end|>).

Weighting, stated once: every supervised token of a micro-batch counts the same (per token), whether the
micro-batch holds one sample, several padded ones or several packed into one row; DeepSpeed then averages
the micro-batches of a step (each weighted 1 / grad_accum).

Implementations (`--loss-impl`), all the same value as the model's own loss:
- torch: logits only at the supervised positions (`logits_to_keep` as a boolean mask), fp32 cross-entropy;
  never the fp32 logits over every position, the first allocation to run out of memory on long videos.
- chunked: the model returns its final hidden states and no logits; lm_head + fp32 cross-entropy run
  `chunk_positions` supervised positions at a time and are recomputed in backward, so at most one chunk's
  [chunk, vocab] logits exist at once (what matters with packing or long answers). Not for a trainable lm_head
  under ZeRO-3 (`auto` then takes torch).
- liger: liger-kernel's fused linear + cross-entropy (Triton, CUDA only; computes the input gradient in the
  forward), where it is installed: its module API, or its ops-level function where liger's transformers
  integration does not import against the installed transformers.
`full_logits` is the reference path: the model's own loss over logits at every position.

The frozen vision tower runs before the language model (train/vision.py): outside autograd, per chunk of
temporal groups, its outputs passed in as `mm_encoder_outputs`.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from train.data import IGNORE_INDEX
from train.packing import unpack_inputs
from train.positions import PositionCache
from train.vision import ENCODER_KEY, WITH_PIXELS_KEY, VisionCache, encode_videos, unwrap

LOSS_IMPLS = ("auto", "torch", "chunked", "liger")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
    """How the forward and the loss are computed (each field is one lever, `train.main --help`)."""

    impl: str = "chunked"  # torch | chunked | liger (auto is resolved by resolve_loss_impl)
    full_logits: bool = False  # reference: logits at every position, the model's own loss
    chunk_positions: int = 1024  # supervised positions per lm_head + cross-entropy chunk (impl chunked)
    vision_no_grad: bool = False  # run the vision tower under no_grad (only when it is entirely frozen)
    vision_chunk_frames: int = 0  # frames per vision-tower pass (0: the whole micro-batch at once)

    @property
    def precompute_vision(self) -> bool:
        """Encode the video before the language model (what either vision lever needs)."""
        return self.vision_no_grad or self.vision_chunk_frames > 0


def _liger_loss_fn():
    """liger's fused linear cross-entropy as fn(weight, hidden, target) -> mean loss: its module API, or, where
    liger's transformers integration fails to import against the installed transformers, its ops-level
    autograd function (which does not touch transformers), called by parameter name."""
    import inspect

    errors = []
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        module = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        return lambda w, h, t: _first(module(w, h, t)), errors
    except Exception as e:  # ImportError, or liger's model patches failing against this transformers
        errors.append(f"liger_kernel.transformers: {type(e).__name__}: {e}")
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as fn

        names = list(inspect.signature(fn.forward).parameters)[1:]  # after ctx
        given = {"_input": None, "weight": None, "target": None, "ignore_index": IGNORE_INDEX, "reduction": "mean"}
        defaults = {n: p.default for n, p in inspect.signature(fn.forward).parameters.items()}
        missing = [n for n in names if n not in given and defaults[n] is inspect.Parameter.empty]
        if missing or names[:3] != ["_input", "weight", "target"]:
            raise TypeError(f"unexpected signature {names}")

        def call(w, h, t):
            values = dict(given, _input=h, weight=w, target=t)
            return _first(fn.apply(*[values[n] if n in values else defaults[n] for n in names]))

        return call, errors
    except Exception as e:
        errors.append(f"liger_kernel.ops: {type(e).__name__}: {e}")
    return None, errors


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def liger_problem() -> str | None:
    """Why liger's fused linear cross-entropy cannot run here, or None."""
    if not torch.cuda.is_available():
        return "--loss-impl liger needs CUDA (liger-kernel is Triton code); use --loss-impl chunked on CPU"
    fn, errors = _liger_loss_fn()
    if fn is None:
        return (f"--loss-impl liger: liger-kernel does not import here ({'; '.join(errors)}); use --loss-impl "
                "chunked (same value, no Triton)")
    return None


def resolve_loss_impl(impl: str, *, lm_head_trainable: bool, zero_stage: int) -> str:
    """auto -> chunked, except for a trainable lm_head under ZeRO-3 (torch)."""
    if impl != "auto":
        return impl
    return "torch" if lm_head_trainable and zero_stage == 3 else "chunked"


SUPERVISED_KEY = "supervised_index"  # flat (row * length + p) positions whose next label is supervised
TARGET_KEY = "supervised_target"  # the labels those positions predict, in the same order


def model_inputs(model, batch: dict[str, torch.Tensor], *, positions: PositionCache | None = None,
                 sample_ids: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The micro-batch as the forward takes it, with every decision that reads its values made here: a packed
    row's per-sample positions (train/packing.py), the mRoPE positions kept per sample (train/positions.py), no
    attention mask where nothing is padded, the supervised positions and their targets as indices.

    Why apart: on a batch already on a GPU each of those reads is a host sync (item, nonzero), ~150 a step at
    64 frames on one H200, every one a gap the GPU waits through (BENCHMARKS.md, session 15). The trainer runs
    this in its loader's workers (WorkerInputs), off the training process: run there on the host, a new 64-frame
    sample's positions took ~30 ms of the step. A prepared batch passes unchanged, so causal_lm_loss runs it for
    callers that pass a raw one (a prepared one holds SUPERVISED_KEY)."""
    if SUPERVISED_KEY in batch:
        return dict(batch)
    batch = dict(unpack_inputs(model, batch))
    if positions is not None and "position_ids" not in batch and batch.get("video_grid_thw") is not None:
        batch["position_ids"] = positions.batch_positions(model, batch, sample_ids)
    mask = batch.get("attention_mask")
    if mask is not None and bool(mask.all()):
        # No padding: causal alone is the mask, so none is passed (sdpa then runs is_causal, no [L, L] tensor).
        del batch["attention_mask"]
    if "labels" in batch:
        labels = batch["labels"]
        supervised = torch.zeros_like(labels, dtype=torch.bool)
        supervised[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # position p is supervised when label p+1 is
        batch[SUPERVISED_KEY] = supervised.flatten().nonzero().squeeze(1)
        batch[TARGET_KEY] = labels.flatten()[batch[SUPERVISED_KEY] + 1]
    return batch


class WorkerInputs:
    """model_inputs as a loader stage (train.data.MicroBatchDataset `inputs`), run in the loader's workers: the
    family's own model built on the meta device (its own get_rope_index; no weights, no memory) and a position
    cache. Build it before a ZeRO-3 model loads: from then on transformers would build even this copy inside
    DeepSpeed's zero.Init, partitioning it with collectives (a worker of a two-rank run hung there)."""

    def __init__(self, config):
        from transformers import AutoModelForImageTextToText
        from transformers.integrations import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            raise RuntimeError("WorkerInputs: built after transformers' ZeRO-3 setup; build it before the model loads")
        with torch.device("meta"):
            self.model = AutoModelForImageTextToText.from_config(config)
        self.positions = PositionCache()

    def __call__(self, batch: dict[str, torch.Tensor], sample_ids: list[str]) -> dict[str, torch.Tensor]:
        return model_inputs(self.model, batch, positions=self.positions, sample_ids=sample_ids)


def causal_lm_loss(model, batch: dict[str, torch.Tensor], spec: LossSpec | None = None, *,
                   full_logits: bool = False, vision_cache: VisionCache | None = None,
                   sample_ids: list[str] | None = None) -> torch.Tensor:
    """Mean cross-entropy over supervised tokens (labels != -100), the same value as the model's own loss.

    Position p predicts token p+1, so only positions whose next label is supervised need logits. `model`
    is what the trainer calls (DeepSpeed engine, PEFT model or plain transformers model). With a vision
    cache the tower runs apart too, its frozen blocks only for the `sample_ids` it does not hold yet. The batch
    may be raw (the model then numbers its own mRoPE positions) or already through `model_inputs` (the trainer's).
    """
    spec = spec or LossSpec(impl="torch", full_logits=full_logits)
    batch = model_inputs(model, batch)
    # No KV cache in training: transformers finds a packed row's sample boundaries only without one, and the
    # text model's own config (use_cache=True) would make one whenever no layer is checkpointed
    batch["use_cache"] = False
    labels = batch.pop("labels")
    index, target = batch.pop(SUPERVISED_KEY), batch.pop(TARGET_KEY)
    with_pixels = batch.pop(WITH_PIXELS_KEY, None)  # hits loaded without frames: only the cache can serve them
    if (spec.precompute_vision or vision_cache is not None or with_pixels is not None) and \
            batch.get("pixel_values_videos") is not None:
        pixels = batch.pop("pixel_values_videos")
        batch["mm_encoder_outputs"] = {ENCODER_KEY: encode_videos(
            model, pixels, batch["video_grid_thw"], chunk_frames=spec.vision_chunk_frames,
            no_grad=spec.vision_no_grad, cache=vision_cache, keys=sample_ids, with_pixels=with_pixels)}
    if spec.full_logits:
        return model(**batch, labels=labels).loss
    if spec.impl == "torch":
        supervised = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        supervised[index] = True
        logits = model(**batch, logits_to_keep=supervised.view_as(labels)).logits  # (n_supervised, vocab)
        return F.cross_entropy(logits.float(), target)
    # chunked / liger: the final hidden states, no logits at all from the model (an empty index: no host sync)
    out = model(**batch, logits_to_keep=index[:0], output_hidden_states=True)
    hidden = out.hidden_states[-1].flatten(0, 1).index_select(0, index)  # (n_supervised, hidden), final-norm output
    del out
    lm_head = unwrap(model).get_output_embeddings()
    if spec.impl == "liger":
        return _liger_loss(lm_head, hidden, target)
    if spec.impl != "chunked":
        raise ValueError(f"unknown loss implementation {spec.impl!r}; choose one of {LOSS_IMPLS}")
    return chunked_cross_entropy(lm_head, hidden, target, chunk=spec.chunk_positions)


def chunked_cross_entropy(lm_head, hidden: torch.Tensor, target: torch.Tensor, *, chunk: int) -> torch.Tensor:
    """mean_i CE(lm_head(hidden_i), target_i), `chunk` rows at a time, in forward and again in backward
    (recomputed from the saved hidden states), so at most one chunk's [chunk, vocab] logits exist at once.

    A custom autograd function rather than torch's checkpoint: under ZeRO-3 the lm_head weight is a
    partitioned parameter that only module hooks gather, and they do not run in a checkpoint's recompute;
    here the weight is gathered explicitly in forward and in backward (train/zero.py)."""
    if lm_head.bias is not None:
        raise ValueError("the chunked loss assumes an lm_head without bias (Qwen3-VL, Qwen3.5)")
    return _LinearCrossEntropy.apply(hidden, lm_head.weight, target, chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    """mean CE(F.linear(hidden, weight).float(), target), computed chunk by chunk; same numerics as lm_head
    in the model dtype followed by an fp32 cross-entropy (what the model's own loss does)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, chunk):
        from train.zero import gathered

        n = target.numel()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad(), gathered([weight]):
            for s in range(0, n, chunk):
                logits = F.linear(hidden[s:s + chunk], weight).float()
                total += F.cross_entropy(logits, target[s:s + chunk], reduction="sum")
        ctx.save_for_backward(hidden, target)
        ctx.weight, ctx.chunk = weight, chunk  # not saved_tensors: ZeRO-3 swaps the parameter's storage
        return total / max(n, 1)

    @staticmethod
    def backward(ctx, grad_out):
        from train.zero import gathered

        hidden, target = ctx.saved_tensors
        weight, chunk = ctx.weight, ctx.chunk
        n = target.numel()
        want_w = ctx.needs_input_grad[1]
        if want_w and hasattr(weight, "ds_id"):
            raise RuntimeError("chunked loss with a trainable, ZeRO-3 partitioned lm_head: use --loss-impl torch")
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        scale = grad_out.float() / max(n, 1)
        with torch.no_grad(), gathered([weight]):
            for s in range(0, n, chunk):
                h, t = hidden[s:s + chunk], target[s:s + chunk]
                g = torch.softmax(F.linear(h, weight).float(), dim=-1)
                g[torch.arange(t.numel(), device=g.device), t] -= 1.0
                g = (g * scale).to(hidden.dtype)  # the grad of .float(), back in the model dtype
                grad_h[s:s + chunk] = g @ weight
                if grad_w is not None:
                    grad_w += (g.t() @ h).float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None


def _liger_loss(lm_head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from train.zero import gathered

    fn, errors = _liger_loss_fn()
    if fn is None:
        raise RuntimeError("liger-kernel does not import: " + "; ".join(errors))
    # liger computes the input gradient inside its forward, so the (ZeRO-3 partitioned) weight is needed there
    # only; the base lm_head is frozen under LoRA (the trainer refuses liger with a trainable lm_head).
    with gathered([lm_head.weight]):
        return fn(lm_head.weight, hidden, target)
