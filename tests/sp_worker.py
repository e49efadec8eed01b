"""One rank of the sequence-parallel equality check (tests/test_sequence_parallel.py starts N of these).

Every rank loads the same tiny Qwen3-VL with the same LoRA (seeded, lora_B given values), joins a gloo group,
computes its partial loss of one sample and backpropagates; the LoRA gradients are summed over the group.
Rank 0 also computes the one-rank reference (the model's own loss over the unsplit sample) and writes both,
with the vision-shard check, to OUT.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist


def lora_model(model_dir: str):
    from peft import LoraConfig, get_peft_model
    from train.models import load_pretrained

    from train.config import DEFAULT_LORA_TARGETS

    model = load_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=DEFAULT_LORA_TARGETS))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model.train()


def batch_of(model_dir: str, shards: str, sample_id: str) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig

    from schemas.prompt import load_tokenizer
    from train.data import SampleStore, VisionSpec, collate

    config = AutoConfig.from_pretrained(model_dir)
    tensors, _ = collate([SampleStore(shards).get(sample_id)], VisionSpec.from_model_config(config),
                         video_token_id=config.video_token_id, pad_token_id=load_tokenizer(model_dir).pad_token_id)
    return tensors


def grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
            if p.requires_grad}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--model", "--shards", "--sample", "--out", "--init"):
        ap.add_argument(name, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=60))
    from train import sequence_parallel as sp
    from train.loss import LossSpec, causal_lm_loss
    from train.vision import inner_model

    group = dist.new_group(list(range(a.world)))
    model = lora_model(a.model)
    batch = batch_of(a.model, a.shards, a.sample)
    result: dict = {}
    if a.rank == 0:  # the one-rank reference: the model's own loss over every position of the unsplit sample
        ref = causal_lm_loss(model, batch, LossSpec(impl="torch", full_logits=True))
        ref.backward()
        result["ref_loss"] = ref.item()
        ref_grads = grads(model)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            full = inner_model(model).get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"],
                                                         return_dict=True)
        full_feats = [torch.cat(full.pooler_output)] + [torch.cat(x) for x in full.deepstack_features]
    calls = {"n": 0}
    inner_attn = sp.ulysses_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return inner_attn(*args, **kwargs)

    sp.ulysses_attention = counted  # _register() picks up the module attribute
    pooled, deep = sp.encode_video_shard(model, batch["pixel_values_videos"], batch["video_grid_thw"], group)
    with sp.ulysses(model, group):  # forward and backward: checkpointing recomputes the attention in backward
        loss, supervised = sp.sequence_parallel_loss(model, batch, group)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    g = grads(model)
    for k in sorted(g):
        dist.all_reduce(g[k], group=group)
    shard = sp.SeqShard.of(batch["input_ids"].shape[1], rank=a.rank, size=a.world)
    local = {"rank": a.rank, "partial_loss": loss.item(), "attention_calls": calls["n"], "start": shard.start,
             "end": shard.end, "supervised_here": int((torch.nn.functional.pad(batch["labels"][:, 1:], (0, shard.padded - shard.length + 1), value=-100)[:, shard.start:shard.end] != -100).sum())}
    gathered: list = [None] * a.world
    dist.all_gather_object(gathered, local, group=group)
    if a.rank == 0:
        def rel(x, y):
            return (x - y).abs().max().item() / (y.abs().max().item() + 1e-12)

        result.update(
            sp_loss=total.item(), supervised=supervised, length=int(batch["input_ids"].shape[1]),
            grid=batch["video_grid_thw"].tolist(), ranks=gathered,
            grad_rel={k: rel(g[k], ref_grads[k]) for k in g}, grad_nonzero=sum(bool(v.abs().sum() > 0) for v in g.values()),
            vision_rel=[rel(x, y) for x, y in zip([pooled, *deep], full_feats)],
            vision_rows=[int(pooled.shape[0]), int(full_feats[0].shape[0])])
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
