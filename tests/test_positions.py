"""Positions kept per sample (train/positions.py): a padded micro-batch gets exactly the model's own
get_rope_index, on first sight and from the kept rows, for both families; the loss and gradients with them
equal the model computing its own; a family that numbers rows otherwise is caught on the first batch of each
layout."""
from __future__ import annotations

import pytest
import torch

from train.loss import LossSpec, causal_lm_loss, model_inputs
from train.positions import PositionCache

IDS = ["vid_a/w0002", "vid_c/w0000", "vid_b/w0001"]  # landscape and portrait grids: rows of different lengths


def _batch(model, shards, ids):
    from train.data import SampleStore, VisionSpec, collate

    store = SampleStore(shards)
    tensors, _ = collate([store.get(i) for i in ids], VisionSpec.from_model_config(model.config),
                         video_token_id=model.config.video_token_id, pad_token_id=0)
    return tensors


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_kept_positions_equal_the_model_own_and_give_the_same_loss(tiny_cache, built_shards, family):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_cache / f"tiny_{family}", dtype=torch.float32).train()
    batch = _batch(model, built_shards, IDS)
    assert not bool(batch["attention_mask"].all())  # padding in the batch: the case that needs the mask
    own, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                        video_grid_thw=batch["video_grid_thw"], attention_mask=batch["attention_mask"])
    cache = PositionCache()
    assert torch.equal(cache.batch_positions(model, batch, IDS), own) and cache.checked == {(3, True)}
    reordered = [2, 0, 1]  # kept rows, another order, no recomputation
    again = _batch(model, built_shards, [IDS[i] for i in reordered])
    ref, _ = model.model.get_rope_index(again["input_ids"], again["mm_token_type_ids"],
                                        video_grid_thw=again["video_grid_thw"], attention_mask=again["attention_mask"])
    assert torch.equal(cache.batch_positions(model, again, [IDS[i] for i in reordered]), ref)

    spec = LossSpec(impl="chunked")
    results = []
    for positions in (None, PositionCache()):
        model.zero_grad()
        loss = causal_lm_loss(model, model_inputs(model, dict(batch), positions=positions, sample_ids=IDS), spec,
                              sample_ids=IDS)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_own, grads_own), (loss_kept, grads_kept) = results
    assert torch.equal(loss_own, loss_kept)
    assert grads_own.keys() == grads_kept.keys() and all(torch.equal(grads_own[n], grads_kept[n]) for n in grads_own)


def test_a_family_numbering_rows_otherwise_fails_on_the_first_batch(tiny_cache, built_shards):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_cache / "tiny_qwen3_vl", dtype=torch.float32)
    own = model.model.get_rope_index

    def shifted(input_ids, *args, **kwargs):  # rows depend on the batch: what the cache assumes never happens
        positions, deltas = own(input_ids, *args, **kwargs)
        return positions + (input_ids.shape[0] > 1), deltas

    model.model.get_rope_index = shifted
    with pytest.raises(RuntimeError, match="differ from the model's own get_rope_index"):
        PositionCache().batch_positions(model, _batch(model, built_shards, IDS), IDS)
    with pytest.raises(ValueError, match="one of each per row"):
        PositionCache().batch_positions(model, _batch(model, built_shards, IDS), IDS[:2])


def test_a_family_numbering_padded_rows_otherwise_fails_on_the_first_padded_batch(tiny_cache, built_shards):
    """A first micro-batch of one row (no padding) checks nothing of the masked path: the first padded one must."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_cache / "tiny_qwen3_vl", dtype=torch.float32)
    own = model.model.get_rope_index

    def shifted(input_ids, *args, attention_mask=None, **kwargs):  # differs only where a row is padded
        positions, deltas = own(input_ids, *args, attention_mask=attention_mask, **kwargs)
        padded = attention_mask is not None and not bool(attention_mask.all())
        return positions + int(padded), deltas

    model.model.get_rope_index = shifted
    cache = PositionCache()
    for sid in IDS:  # one row each: unpadded, checked once
        cache.batch_positions(model, _batch(model, built_shards, [sid]), [sid])
    assert cache.checked == {(1, False)}
    with pytest.raises(RuntimeError, match=r"3 rows, padded: True"):
        cache.batch_positions(model, _batch(model, built_shards, IDS), IDS)
