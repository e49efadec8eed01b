"""The vision cache (train/vision.py, --vision-cache-gib): the cached path gives the model's own video features
bit for bit (CPU fp32) on a first pass, on a repeat and on a batch mixing both; it refuses towers whose frozen
part would not repeat itself; and a train.main run with it gives the same per-step losses as without."""
from __future__ import annotations

import json

import pytest
import torch

from tests.train_helpers import events, explain, launch, steps, subset_shards
from train.vision import WITH_PIXELS_KEY, VisionCache, cache_problems, cached_levels, encode_videos, entry_bytes

IDS = ["vid_a/w0002", "vid_c/w0000", "vid_b/w0001"]  # two grids (landscape, portrait), three samples


def _model(tiny_cache, family: str, vision: dict | None = None):
    """The tiny model in train mode (mergers trainable, blocks frozen, as in the demo's recipe); `vision` changes
    the tower's shape (a random model of the same family)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = tiny_cache / f"tiny_{family}"
    if vision is None:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(path)
        for k, v in vision.items():
            setattr(config.vision_config, k, v)
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(".merger." in name or "deepstack_merger_list" in name)
    return model.train()


def _videos(model, shards, ids):
    from train.data import SampleStore, VisionSpec, collate

    store = SampleStore(shards)
    tensors, _ = collate([store.get(i) for i in ids], VisionSpec.from_model_config(model.config),
                         video_token_id=model.config.video_token_id, pad_token_id=0)
    return tensors["pixel_values_videos"], tensors["video_grid_thw"]


def _assert_equal(got, ref) -> None:
    assert len(got.pooler_output) == len(ref.pooler_output)
    for a, b in zip(got.pooler_output, ref.pooler_output):
        assert torch.equal(a, b)
    deep_got, deep_ref = getattr(got, "deepstack_features", None) or [], getattr(ref, "deepstack_features", None) or []
    assert len(deep_got) == len(deep_ref)
    for la, lb in zip(deep_got, deep_ref):
        for a, b in zip(la, lb):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family,vision,levels", [
    ("qwen3_vl", None, (0, 1)),  # deepstack at both blocks: the last block's output serves the merger too
    ("qwen3_vl", {"depth": 3, "deepstack_visual_indexes": [0]}, (0, 2)),  # a deepstack block apart from the last
    ("qwen3_5", None, (1,)),  # no deepstack: the last block only
])
def test_cached_path_equals_the_model_own_video_features(tiny_cache, built_shards, family, vision, levels):
    model = _model(tiny_cache, family, vision)
    assert cached_levels(model.model.visual) == levels
    pixels, grids = _videos(model, built_shards, IDS)
    with torch.no_grad():
        ref = model.model.get_video_features(pixels, grids, return_dict=True)
    cache = VisionCache(1 << 30)
    for chunk_frames in (0, 4):  # the whole batch in one tower pass, or chunks that split a video
        cache = VisionCache(1 << 30)
        first = encode_videos(model, pixels, grids, chunk_frames=chunk_frames, no_grad=False, cache=cache, keys=IDS)
        _assert_equal(first, ref)
        assert (cache.stats.hits, cache.stats.misses, cache.stats.entries, cache.stats.checked) == (0, 3, 3, True)
        again = encode_videos(model, pixels, grids, chunk_frames=chunk_frames, no_grad=False, cache=cache, keys=IDS)
        _assert_equal(again, ref)
        assert (cache.stats.hits, cache.stats.misses) == (3, 3)
        assert again.pooler_output[0].requires_grad  # the trained merger gets its gradient on a hit too
    # a batch mixing a new sample with cached ones, in another order: the model's own features of that batch
    mixed = ["vid_d/w0000", IDS[1], IDS[0]]
    pixels, grids = _videos(model, built_shards, mixed)
    with torch.no_grad():
        ref = model.model.get_video_features(pixels, grids, return_dict=True)
    _assert_equal(encode_videos(model, pixels, grids, chunk_frames=4, no_grad=False, cache=cache, keys=mixed), ref)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.entries) == (5, 4, 4)


def test_the_bound_stops_storing_and_a_wrong_grid_or_missing_keys_fail(tiny_cache, built_shards):
    model = _model(tiny_cache, "qwen3_vl")
    pixels, grids = _videos(model, built_shards, IDS)
    with torch.no_grad():
        ref = model.model.get_video_features(pixels, grids, return_dict=True)
    one = VisionCache(1 << 30)
    encode_videos(model, pixels[:int(grids[0].prod())], grids[:1], cache=one, keys=IDS[:1])
    small = VisionCache(one.stats.bytes)  # room for the first sample only
    for _ in range(2):
        _assert_equal(encode_videos(model, pixels, grids, cache=small, keys=IDS), ref)
    assert (small.stats.entries, small.stats.not_stored, small.stats.hits, small.stats.misses) == (1, 4, 1, 5)
    assert small.stats.bytes <= small.max_bytes and "1 samples" in small.line()
    with pytest.raises(RuntimeError, match="sample vid_a/w0002 came with grid"):
        encode_videos(model, pixels[:int(grids[1].prod())], grids[1:2], cache=small, keys=IDS[:1])
    with pytest.raises(ValueError, match="one key"):
        encode_videos(model, pixels, grids, cache=small, keys=None)
    # a tower that does more after its blocks than the heads: the first batch with misses says so
    own = model.model.visual.forward

    def shifted(*args, **kwargs):
        out = own(*args, **kwargs)
        out.pooler_output = out.pooler_output + 1
        return out

    model.model.visual.forward = shifted
    with pytest.raises(RuntimeError, match="do not reproduce the model's own video features"):
        encode_videos(model, pixels, grids, cache=VisionCache(1 << 30), keys=IDS)


def test_planned_hits_load_without_frames_and_give_the_model_own_features(tiny_cache, built_shards):
    """VisionCache.plan with room for two of three samples: the loader reads the planned hits without their
    frames (no pixel rows), every micro-batch still encodes to the model's own features from full pixels, and
    the cache stores exactly what was planned; a miss that comes without pixels fails."""
    from train.data import MicroBatchDataset, SampleStore, VisionSpec
    from train.plan import MicroBatch

    model = _model(tiny_cache, "qwen3_vl")
    store = SampleStore(built_shards)
    grid = {sid: (r.grid_t, r.grid_h, r.grid_w) for sid in IDS for r in [store.record(sid)]}
    sizes = {sid: entry_bytes(model, grid[sid]) for sid in IDS}
    order = [[IDS[0], IDS[1]], [IDS[1], IDS[2]], [IDS[2], IDS[0]], [IDS[1], IDS[1]]]
    cache = VisionCache(sizes[IDS[0]] + sizes[IDS[1]])  # IDS[2] never fits
    hits = cache.plan(order, sizes)
    assert hits == [[False, False], [True, False], [False, True], [True, True]]
    data = MicroBatchDataset(store, [MicroBatch(sample_ids=ids, repeat=[False] * len(ids)) for ids in order],
                             VisionSpec.from_model_config(model.config), video_token_id=model.config.video_token_id,
                             pad_token_id=0, cached=hits)
    for i, ids in enumerate(order):
        tensors, _ = data[i]
        rows = sum(grid[sid][0] * grid[sid][1] * grid[sid][2] for sid, hit in zip(ids, hits[i]) if not hit)
        assert tensors["pixel_values_videos"].shape[0] == rows
        assert (WITH_PIXELS_KEY in tensors) == any(hits[i])
        pixels, grids = _videos(model, built_shards, ids)
        with torch.no_grad():
            ref = model.model.get_video_features(pixels, grids, return_dict=True)
        _assert_equal(encode_videos(model, tensors["pixel_values_videos"], tensors["video_grid_thw"], no_grad=False,
                                    cache=cache, keys=ids, with_pixels=tensors.get(WITH_PIXELS_KEY)), ref)
    assert (cache.stats.entries, cache.stats.not_stored, cache.stats.hits) == (2, 2, 4)
    with pytest.raises(RuntimeError, match="came without pixels but are not cached"):
        encode_videos(model, pixels[:0], grids, cache=VisionCache(1 << 30), keys=ids,
                      with_pixels=torch.tensor([False, False]))


def test_a_tower_whose_frozen_part_changes_is_refused(tiny_cache):
    model = _model(tiny_cache, "qwen3_vl")
    assert cache_problems(model) == []
    model.model.visual.blocks[0].mlp.linear_fc1.weight.requires_grad_(True)
    model.model.visual.blocks[1].attn.attention_dropout = 0.1
    problems = cache_problems(model)
    assert len(problems) == 2
    assert "blocks.0.mlp.linear_fc1.weight" in problems[0] and "--unfreeze-vision" in problems[0]
    assert "blocks.1.attn drops out at 0.1" in problems[1]


def test_train_main_with_the_cache_gives_the_same_losses(built_shards, tiny_cache, tmp_path):
    """Full fine-tune with the mergers trained (the demo's recipe in miniature): 3 samples x 3 epochs, two per
    step (tail pad: epoch 0's second step mixes a new sample with a cached one; later steps hit the cache);
    losses and gradient norms equal a run without it."""
    shards = subset_shards(built_shards, tmp_path / "three", IDS)
    runs = {}
    for name, extra in (("off", []), ("on", ["--vision-cache-gib", "0.5"])):
        run = tmp_path / name
        proc = launch(["--shards", str(shards), "--output-dir", str(run), "--model", str(tiny_cache / "tiny_qwen3_vl"),
                       "--finetune", "full", "--unfreeze-merger", "--epochs", "3", "--micro-batch-size", "2", "--tail", "pad",
                       "--zero-stage", "0", "--dtype", "fp32", "--num-workers", "0", "--lr", "1e-3",
                       "--no-gradient-checkpointing", "--vision-chunk-frames", "4", *extra], nproc=0, timeout=240)
        assert proc.returncode == 0, explain(proc)
        runs[name] = steps(run, 0)
    off, on = runs["off"], runs["on"]
    assert sorted(on) == sorted(off) == list(range(6))
    for s in off:
        assert on[s]["sample_ids"] == off[s]["sample_ids"]
        assert on[s]["loss"] == off[s]["loss"] and on[s]["grad_norm"] == off[s]["grad_norm"], (s, on[s], off[s])
    assert on[1]["repeat"] == [False, True] and on[1]["vision_cache"] == {"hits": 1, "misses": 3}  # mixed step
    assert on[5]["vision_cache"] == {"hits": 9, "misses": 3} and off[5]["vision_cache"] is None
    (summary,) = events(tmp_path / "on", 0, "vision_cache")
    assert summary["entries"] == 3 and summary["checked"] and summary["not_stored"] == 0
    (plan,) = events(tmp_path / "on", 0, "vision_cache_plan")  # the hits were loaded without their frames
    assert (plan["stored"], plan["loaded_without_frames"], plan["loads"]) == (3, 9, 12)
    refused = launch(["--shards", str(shards), "--output-dir", str(tmp_path / "refused"), "--model",
                      str(tiny_cache / "tiny_qwen3_vl"), "--finetune", "full", "--unfreeze-vision", "--epochs", "1",
                      "--micro-batch-size", "1", "--zero-stage", "0", "--dtype", "fp32", "--num-workers", "0",
                      "--vision-cache-gib", "0.5"], nproc=0, timeout=240)
    assert refused.returncode == 2 and "drop --unfreeze-vision" in refused.stderr, explain(refused)
    assert json.loads((tmp_path / "refused" / "run.json").read_text())["status"] == "failed"
