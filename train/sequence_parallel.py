"""Sequence parallelism: one long window (one sample) split along its tokens over the N ranks of a group.

What each piece does, and why it stays exact (tests/test_sequence_parallel.py: loss and LoRA gradients equal
the one-rank computation):
- positions: `get_rope_index` numbers the whole sequence on every rank (it needs only the token ids and the
  grid, no weights), then each rank keeps its slice, so rank r's tokens carry the positions they would
  have had unsplit. The sequence is padded at the end to a multiple of N; pads come after every real token,
  so under causal attention no real token sees them, and their labels are -100.
- vision: the tower is sharded by temporal group. transformers' `get_vision_cu_seqlens` gives every temporal
  group its own attention segment (`merge_temporal=False`; train/vision.py says why chunking is exact), so
  rank r encodes only its share of the groups (`plan_chunks`, the same helper the chunked vision lever uses),
  and an all-gather of the merged embeddings (hidden-size rows, one per visual token: small next to the
  tower's activations over every patch) gives each rank the rows its slice needs. The tower must be frozen:
  its outputs are exchanged without autograd.
- attention (Ulysses): inside each text attention layer q, k, v of the local slice are exchanged all-to-all
  from [local tokens, all heads] to [all tokens, heads / N], causal sdpa runs over the whole sequence, and
  the output goes back the same way; the all-to-all is its own adjoint, so backward is another all-to-all.
  Key/value heads are repeated to the query heads first when N does not divide their count (GQA).
  The core is torch's sdpa (causal, no mask): `--attention flash_attention_2` does not apply to the LLM here.
- loss: each rank's partial loss is the sum of its supervised tokens' cross-entropy divided by the global
  supervised count, so the partial losses (and the LoRA gradients) summed over the group are the one-rank
  values. Under a data-parallel gradient average over the group the trainer multiplies by N.

Why not DeepSpeed's ALST (`deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`, 0.19.8): it
registers itself for the model's whole attention implementation (the vision tower's attention included,
which must not be split by tokens here), builds its own Megatron-style groups (`parallel_state_sp`) and its
data-loader adapter shards `input_ids`/`labels`/`position_ids` before the model, where the video embeddings and
mRoPE positions of a VLM do not exist yet. Its all-to-all attention is the same idea as `_AllToAll` below.

Qwen3.5 is refused: its linear-attention layers carry a recurrent state along the sequence, which an
all-to-all over heads does not split.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.data import IGNORE_INDEX
from train.loss import chunked_cross_entropy
from train.vision import inner_model, plan_chunks, unwrap

ATTN_NAME = "video_ora_ulysses"  # the attention implementation name registered with transformers
_GROUP: list = []  # the process group of the `ulysses()` context in force (a stack: innermost last)


class SequenceParallelError(ValueError):
    """The batch or model cannot be split as asked; the message says why and what to change."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeqShard:
    """The token range one rank holds of a sequence padded to a multiple of the group size."""

    rank: int  # rank within the sequence-parallel group
    size: int  # ranks in the group
    length: int  # real tokens of the sample
    padded: int  # length rounded up to a multiple of size
    start: int  # first token of this rank's slice (padded coordinates)
    end: int  # one past its last token

    @classmethod
    def of(cls, length: int, *, rank: int, size: int) -> "SeqShard":
        if size < 1 or not 0 <= rank < size:
            raise SequenceParallelError(f"rank {rank} of a sequence-parallel group of {size}")
        per = math.ceil(length / size)
        return cls(rank=rank, size=size, length=length, padded=per * size, start=rank * per, end=(rank + 1) * per)


# ------------------------------------------------------------------------------------------------ all-to-all
class _AllToAll(torch.autograd.Function):
    """Equal blocks along dim 0: block j goes to rank j, block i of the output came from rank i. A block
    permutation, so its adjoint is the same exchange on the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # not x's strides: the exchange is flat
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, H, s, d] (all heads, this rank's tokens) -> [b, H/N, N*s, d] (this rank's heads, all tokens)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    blocks = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # [N, b, H/N, s, d]: block j = heads of rank j
    got = _AllToAll.apply(blocks, group)  # got[i] = my heads of rank i's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of seq_to_heads: [b, H/N, N*s, d] -> [b, H, s, d]."""
    n = dist.get_world_size(group)
    b, hl, S, d = x.shape
    blocks = x.reshape(b, hl, n, S // n, d).permute(2, 0, 1, 3, 4)  # block j = rank j's tokens, my heads
    got = _AllToAll.apply(blocks, group)  # got[i] = rank i's heads of my tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * hl, S // n, d)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention interface: q [b, Hq, s, d], k/v [b, Hkv, s, d] of the local tokens -> output
    [b, s, Hq, d]. Causal over the whole sequence; no mask (the sample is one unpadded row)."""
    if not _GROUP:
        raise RuntimeError(f"attention {ATTN_NAME!r} called outside train.sequence_parallel.ulysses()")
    if attention_mask is not None:
        raise SequenceParallelError("sequence parallel attention takes no mask: one unpadded sample per group")
    group = _GROUP[-1]
    n = dist.get_world_size(group)
    hq, hkv = query.shape[1], key.shape[1]
    if hq % n:
        raise SequenceParallelError(f"{hq} attention heads do not split over {n} sequence-parallel ranks")
    if hkv % n:  # GQA with fewer kv heads than ranks: give every query head its own copy
        key = key.repeat_interleave(hq // hkv, dim=1)
        value = value.repeat_interleave(hq // hkv, dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return heads_to_seq(out, group).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # causal over the whole sequence is what ulysses_attention does; no [s, S] mask is built


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


@contextlib.contextmanager
def ulysses(model, group):
    """The language model's attention (only it: the vision tower keeps its own) runs as Ulysses over
    `group` inside the block. Forward AND backward go inside it: activation checkpointing recomputes the
    attention in backward, and a recompute with the plain attention would see only the local tokens."""
    _register()
    config = inner_model(model).language_model.config
    before = config._attn_implementation
    config._attn_implementation = ATTN_NAME
    _GROUP.append(group)
    try:
        yield
    finally:
        _GROUP.pop()
        config._attn_implementation = before


# ------------------------------------------------------------------------------------------------ vision
def encode_video_shard(model, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor, group
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank encodes its share of the temporal groups; returns every visual token's embedding (all
    videos, in order) and the deepstack features, gathered from the group. Frozen tower, no autograd."""
    inner = inner_model(model)
    visual = inner.visual
    if any(p.requires_grad for p in visual.parameters()):
        raise SequenceParallelError("sequence parallel needs a frozen vision tower (its outputs are exchanged "
                                    "without autograd); train the LLM only")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    merge = int(visual.spatial_merge_size) ** 2
    grids = [tuple(int(x) for x in g) for g in video_grid_thw.tolist()]
    total = sum(t for t, _, _ in grids)
    chunks = plan_chunks(grids, math.ceil(total / n))  # at most n chunks of consecutive groups, in video order
    row_start = [0]
    for t, h, w in grids:
        row_start.append(row_start[-1] + t * h * w)
    tokens = [sum((s.t1 - s.t0) * grids[s.video][1] * grids[s.video][2] // merge for s in c) for c in chunks]
    tokens += [0] * (n - len(chunks))
    hidden = int(getattr(visual.config, "out_hidden_size", 0) or visual.config.hidden_size)
    levels = len(getattr(visual.config, "deepstack_visual_indexes", []) or [])
    dtype = next(visual.parameters()).dtype
    device = pixel_values_videos.device
    mine = torch.zeros(max(tokens), (1 + levels) * hidden, dtype=dtype, device=device)
    if rank < len(chunks):
        rows, sub = [], []
        for s in chunks[rank]:
            t, h, w = grids[s.video]
            rows.append(pixel_values_videos[row_start[s.video] + s.t0 * h * w:row_start[s.video] + s.t1 * h * w])
            sub.append((s.t1 - s.t0, h, w))
        with torch.no_grad():
            out = inner.get_video_features(torch.cat(rows), torch.tensor(sub, dtype=video_grid_thw.dtype,
                                                                         device=video_grid_thw.device),
                                           return_dict=True)
        feats = [torch.cat(out.pooler_output)] + [torch.cat(level) for level in (out.deepstack_features or [])]
        mine[:tokens[rank]] = torch.cat(feats, dim=-1).to(dtype)
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    joined = torch.cat([p[:k] for p, k in zip(parts, tokens)])
    pieces = joined.split(hidden, dim=-1)
    return pieces[0], list(pieces[1:])


# ------------------------------------------------------------------------------------------------ loss
def sp_problems(model, batch: dict[str, torch.Tensor], size: int) -> list[str]:
    """Why this model/batch cannot run sequence parallel over `size` ranks (empty: it can)."""
    problems = []
    hf = unwrap(model)
    if type(hf).__name__ != "Qwen3VLForConditionalGeneration":
        problems.append(f"sequence parallel supports Qwen3-VL only, not {type(hf).__name__} (Qwen3.5's "
                        "linear-attention layers carry state along the sequence)")
    text = inner_model(model).language_model.config
    if text.num_attention_heads % size:
        problems.append(f"{text.num_attention_heads} attention heads do not split over {size} ranks")
    if batch["input_ids"].shape[0] != 1:
        problems.append(f"one sample per sequence-parallel group, got a micro-batch of {batch['input_ids'].shape[0]}")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        problems.append("the sample is padded; sequence parallel takes one unpadded row")
    if "pack_lengths" in batch:
        problems.append("packed rows are not supported under sequence parallel")
    grid = batch.get("video_grid_thw")
    if grid is not None and int(grid[:, 0].sum()) < size:
        # every rank must run the tower (under ZeRO-3 its parameter gathers are collectives)
        problems.append(f"{int(grid[:, 0].sum())} temporal groups in the video, fewer than the {size} ranks "
                        "that shard the vision tower")
    return problems


def sequence_parallel_loss(model, batch: dict[str, torch.Tensor], group, *, chunk_positions: int = 1024
                           ) -> tuple[torch.Tensor, int]:
    """This rank's partial loss of one sample split over `group`, and the sample's supervised count.

    partial = sum over this rank's supervised positions of CE / supervised count of the whole sample, so the
    sum over the group's ranks is the one-rank mean loss (and the summed LoRA gradients the one-rank ones).
    Call it, and backpropagate, inside `with ulysses(model, group):`."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    problems = sp_problems(model, batch, n)
    if problems:
        raise SequenceParallelError("sequence parallel: " + "; ".join(problems))
    hf, inner = unwrap(model), inner_model(model)
    input_ids, labels = batch["input_ids"], batch["labels"]
    length = input_ids.shape[1]
    shard = SeqShard.of(length, rank=rank, size=n)
    pad = shard.padded - length

    # positions of the whole sequence, then this rank's slice (pads continue the last position)
    positions, _ = inner.get_rope_index(input_ids, batch["mm_token_type_ids"], video_grid_thw=batch.get("video_grid_thw"))
    if pad:
        tail = positions.amax(dim=(0, 2), keepdim=True) + 1 + torch.arange(pad, device=positions.device).view(1, 1, pad)
        positions = torch.cat([positions, tail.expand(positions.shape[0], -1, -1)], dim=2)
    positions = positions[:, :, shard.start:shard.end]

    pad_id = int(hf.config.text_config.pad_token_id or 0)
    ids = F.pad(input_ids, (0, pad), value=pad_id)
    # position p predicts token p+1: shift over the whole sample before slicing, pads unsupervised
    target_all = F.pad(labels[:, 1:], (0, pad + 1), value=IGNORE_INDEX)
    local_ids = ids[:, shard.start:shard.end]
    target = target_all[:, shard.start:shard.end]
    supervised_total = int((labels[:, 1:] != IGNORE_INDEX).sum())

    embeds = inner.get_input_embeddings()(local_ids)
    visual_mask = None
    deep_local = None
    if batch.get("pixel_values_videos") is not None:
        video = ids == hf.config.video_token_id
        pooled, deep = encode_video_shard(model, batch["pixel_values_videos"], batch["video_grid_thw"], group)
        if pooled.shape[0] != int(video.sum()):
            raise SequenceParallelError(f"{int(video.sum())} video tokens in the sample, {pooled.shape[0]} embeddings")
        first = int(video[:, :shard.start].sum())
        visual_mask = video[:, shard.start:shard.end]
        count = int(visual_mask.sum())
        embeds = embeds.masked_scatter(visual_mask.unsqueeze(-1), pooled[first:first + count].to(embeds.dtype))
        deep_local = [d[first:first + count] for d in deep] or None

    if not _GROUP or _GROUP[-1] is not group:
        raise RuntimeError("sequence_parallel_loss runs inside `with ulysses(model, group):` (with its backward)")
    out = inner.language_model(inputs_embeds=embeds, position_ids=positions, visual_pos_masks=visual_mask,
                               deepstack_visual_embeds=deep_local)
    keep = target != IGNORE_INDEX
    hidden = out.last_hidden_state[keep]
    local = chunked_cross_entropy(hf.get_output_embeddings(), hidden, target[keep], chunk=chunk_positions)
    return local * (int(keep.sum()) / max(supervised_total, 1)), supervised_total


# ------------------------------------------------------------------------------------------------ layout
def rank_layout(rank: int, world_size: int, size: int) -> tuple[int, int, int]:
    """(data-parallel rank, rank within its sequence-parallel group, data-parallel world) when consecutive
    ranks [k*size, (k+1)*size) share one sample (within one host first: the all-to-all is the busiest link)."""
    if size < 1 or world_size % size:
        raise SequenceParallelError(f"--sequence-parallel {size}: the world size {world_size} is not a multiple of it")
    return rank // size, rank % size, world_size // size


def new_groups(rank: int, world_size: int, size: int):
    """This rank's sequence-parallel process group. Every rank creates every group, in the same order
    (torch.distributed requires it), and keeps its own."""
    mine = None
    for k in range(world_size // size):
        group = dist.new_group(list(range(k * size, (k + 1) * size)))
        if k == rank // size:
            mine = group
    return mine


def model_problems(family: str, text_config, size: int) -> list[str]:
    """What the model's family and heads allow, from config.json alone (checked before the load)."""
    p = []
    if family != "qwen3_vl":
        p.append(f"--sequence-parallel supports qwen3_vl, not {family} (Qwen3.5's linear-attention layers carry "
                 "state along the sequence)")
    if text_config.num_attention_heads % size:
        p.append(f"--sequence-parallel {size}: {text_config.num_attention_heads} attention heads do not split over it")
    return p
