"""Reading samples from shards, HF-exact patchify, collate, pre-flight and the ordered rank loader."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from schemas import SampleRecord, write_records
from schemas.prompt import load_tokenizer, special_id, tokenize_sample
from schemas.shard import JSON_EXT, ShardSample, frame_ext
from train.data import (
    IGNORE_INDEX,
    LoadedSample,
    PreflightError,
    SampleError,
    SampleStore,
    VisionSpec,
    collate,
    patchify,
    preflight,
    preflight_records,
    rank_loader,
)
from tests.records import v2_fields
from train.plan import MicroBatch

SPEC = VisionSpec()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    return {"video_token_id": special_id(tok, "<|video_pad|>"), "pad_token_id": tok.pad_token_id}


def smooth_frames(T: int, H: int, W: int, seed: int) -> np.ndarray:
    """Frames JPEG keeps close: gradients plus a moving square."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:H, 0:W]
    base = np.stack([x * 255 // max(W - 1, 1), y * 255 // max(H - 1, 1), np.full_like(x, rng.integers(0, 256))], -1)
    frames = np.repeat(base[None], T, 0).astype(np.uint8)
    for t in range(T):
        frames[t, 4 + t: 12 + t, 4: 12] = (255, 0, 0)
    return frames


def jpeg(frame: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_sample(tok, i: int, *, T=4, H=64, W=64, answer="[[0.0, 1.5]]", video="vid") -> tuple[ShardSample, list[bytes]]:
    gt, gh, gw = T // 2, H // 16, W // 16
    per_group = gh * gw // 4
    times = [float(g) for g in range(gt)]
    query = "Which parts are worth keeping?"
    t = tokenize_sample(tok, query=query, answer=answer, group_times_s=times, tokens_per_group=per_group,
                        layout="nested")
    jpegs = [jpeg(f) for f in smooth_frames(T, H, W, seed=i)]
    record = SampleRecord(
        sample_id=f"{video}/w{i:04d}", video_id=video, source_path=f"{video}.mp4", window_index=i,
        window_start_s=float(i), window_end_s=float(i + T / 2), num_frames=T, frame_indices=[2 * i + k for k in range(T)],
        frame_times_s=[i + k / 2 for k in range(T)], group_times_s=times, height=H, width=W, grid_t=gt, grid_h=gh,
        grid_w=gw, visual_tokens=t.visual_tokens, text_tokens=t.text_tokens, supervised_tokens=t.supervised_tokens,
        input_tokens=len(t.input_ids), query=query, answer=answer, segments=[], shard="", key=f"{video}__w{i:04d}",
        **v2_fields(T, fps=2.0, width=W, height=H, input_ids=t.input_ids,
                    frame_sha256=[hashlib.sha256(d).hexdigest() for d in jpegs]),
    )
    return ShardSample(record=record, input_ids=t.input_ids, prompt_tokens=t.prompt_tokens), jpegs


def write_shards(tmp_path, samples_per_shard: list[list[tuple[ShardSample, list[bytes]]]]):
    """A minimal build following schemas/shard.py, written with webdataset's TarWriter."""
    import webdataset as wds

    records = []
    for n, samples in enumerate(samples_per_shard):
        name = f"shard-{n:06d}.tar"
        with wds.TarWriter(str(tmp_path / name)) as sink:
            for sample, jpegs in samples:
                sample.record.shard = name
                member = {"__key__": sample.record.key, JSON_EXT: json.dumps(sample.to_json()).encode()}
                member.update({frame_ext(k): data for k, data in enumerate(jpegs)})
                sink.write(member)
                records.append(sample.record)
    write_records(tmp_path / "manifest.parquet", records, SampleRecord)
    return tmp_path


@pytest.fixture
def tiny_build(tmp_path, tok):
    shards = [
        [make_sample(tok, 0), make_sample(tok, 1, T=6, H=32, W=96, answer="[]")],
        [make_sample(tok, 2, T=2, H=96, W=32, answer="[[0.0, 0.5], [0.5, 1.0]]"), make_sample(tok, 3)],
    ]
    write_shards(tmp_path, shards)
    return tmp_path, {s.record.sample_id: (s, j) for shard in shards for s, j in shard}


# ---------------------------------------------------------------------------------------------------------
# patchify


@pytest.mark.parametrize("shape", [(2, 32, 32), (4, 64, 96), (6, 96, 32), (8, 128, 224)])
def test_patchify_equals_hf_video_processor(shape):
    from transformers import Qwen3VLVideoProcessor

    frames = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    hf = Qwen3VLVideoProcessor(cap_pixels_per_frame=True)(
        videos=[frames], do_resize=False, do_sample_frames=False, return_tensors="pt"
    )
    pixels, grid = patchify(frames, SPEC)
    assert pixels.dtype == torch.float32 and pixels.shape == hf["pixel_values_videos"].shape
    assert torch.allclose(pixels, hf["pixel_values_videos"], atol=1e-6, rtol=0)
    assert [list(grid)] == hf["video_grid_thw"].tolist()


def test_collated_pixels_equal_hf_on_a_batch_of_videos():
    from transformers import Qwen3VLVideoProcessor

    rng = np.random.default_rng(3)
    videos = [rng.integers(0, 256, s, dtype=np.uint8) for s in [(4, 64, 32, 3), (2, 32, 96, 3), (4, 64, 32, 3)]]
    hf = Qwen3VLVideoProcessor(cap_pixels_per_frame=True)(
        videos=videos, do_resize=False, do_sample_frames=False, return_tensors="pt"
    )
    mine = torch.cat([patchify(v, SPEC)[0] for v in videos])
    assert torch.allclose(mine, hf["pixel_values_videos"], atol=1e-6, rtol=0)


def test_patchify_refuses_what_the_budget_never_produces():
    with pytest.raises(ValueError, match="divisible"):
        patchify(np.zeros((3, 32, 32, 3), np.uint8), SPEC)
    with pytest.raises(ValueError, match="divisible"):
        patchify(np.zeros((2, 48, 32, 3), np.uint8), SPEC)
    with pytest.raises(ValueError, match="uint8"):
        patchify(np.zeros((2, 32, 32, 3), np.float32), SPEC)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_vision_spec_from_model_config(family):
    from train.models import build_config, load_shape

    _, shape = load_shape(f"tiny_{family}")
    assert VisionSpec.from_model_config(build_config(family, shape)) == SPEC
    shape["vision"] = {**shape["vision"], "patch_size": 14, "spatial_merge_size": 4}
    spec = VisionSpec.from_model_config(build_config(family, shape))
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (14, 4, 2)
    assert spec.patch_dim == 3 * 2 * 14 * 14


# ---------------------------------------------------------------------------------------------------------
# SampleStore


def test_store_reads_what_was_written(tiny_build):
    root, written = tiny_build
    store = SampleStore(root)
    assert len(store) == 4
    for sid, (sample, jpegs) in written.items():
        got = store.get(sid)
        assert got.record == sample.record
        assert got.input_ids == sample.input_ids and got.prompt_tokens == sample.prompt_tokens
        r = sample.record
        assert got.frames.dtype == np.uint8 and got.frames.shape == (r.num_frames, r.height, r.width, 3)
        for k, data in enumerate(jpegs):
            assert np.array_equal(got.frames[k], np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_store_indexes_only_the_shards_it_needs(tiny_build):
    root, _ = tiny_build
    store = SampleStore(root)
    store.index_for(["vid/w0002"])
    assert set(store.reader._index) == {"shard-000001.tar"}


def test_store_names_the_sample_on_a_missing_member(tiny_build):
    root, written = tiny_build
    import webdataset as wds

    sample, jpegs = written["vid/w0000"]
    with wds.TarWriter(str(root / "shard-000000.tar")) as sink:  # rewrite shard 0 without the last frame
        sink.write({"__key__": sample.record.key, JSON_EXT: json.dumps(sample.to_json()).encode(),
                    **{frame_ext(k): d for k, d in enumerate(jpegs[:-1])}})
    with pytest.raises(SampleError, match=r"sample vid/w0000: member vid__w0000\.f003\.jpg is missing from shard shard-000000\.tar"):
        SampleStore(root).get("vid/w0000")
    with pytest.raises(SampleError, match="'nope/w0000' is not in"):
        SampleStore(root).get("nope/w0000")


def test_store_refuses_a_manifest_from_another_build(tiny_build):
    root, written = tiny_build
    records = [dataclasses.replace(s.record) for s, _ in written.values()]
    records[0].answer = "[[9.0, 9.5]]"
    with pytest.raises(SampleError, match=r"vid/w0000: .*disagrees with the manifest on \['answer'\]"):
        SampleStore(root, records=records).get("vid/w0000")


def test_prep_build_through_plan_loader_and_ledger(built_shards, tok, ids, tmp_path):
    """A real `python -m prep build` output: every sample loads, passes pre-flight with the tokenizer, and
    two ranks' loaders consume the plan exactly once (the ledger proves it)."""
    from train.ledger import append_ledger, check_ledger
    from train.plan import PlanConfig, global_steps, plan_run

    store = SampleStore(built_shards)
    records = list(store.records.values())
    assert len(records) == 12
    preflight_records(records)
    plans = plan_run(records, PlanConfig(world_size=2, grad_accum=2, seed=3), epochs=1)
    assert plans[0].num_steps == 3
    for rank in range(2):
        steps = list(global_steps(plans, rank))
        flat = [mb for *_, accum in steps for mb in accum]
        batches = iter(rank_loader(store, flat, SPEC, **ids, tokenizer=tok, num_workers=1))
        for g, _, _, accum in steps:
            for mb in accum:
                tensors, meta = next(batches)
                assert meta.sample_ids == mb.sample_ids
                r = store.record(mb.sample_ids[0])
                assert tensors["video_grid_thw"].tolist() == [[r.grid_t, r.grid_h, r.grid_w]]
                assert tensors["pixel_values_videos"].shape == (r.grid_t * r.grid_h * r.grid_w, SPEC.patch_dim)
                assert int((tensors["mm_token_type_ids"] == 2).sum()) == r.visual_tokens
            append_ledger(tmp_path, g, rank, accum)
        assert next(batches, None) is None
    report = check_ledger(tmp_path, plans)
    assert report.ok and report.message() == "epoch 0: 12/12 planned samples consumed exactly once (0 pad repeats, 0 dropped)"


# ---------------------------------------------------------------------------------------------------------
# collate


def loaded(tok, i, **kw) -> LoadedSample:
    sample, jpegs = make_sample(tok, i, **kw)
    frames = np.stack([np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in jpegs])
    return LoadedSample(record=sample.record, input_ids=sample.input_ids, prompt_tokens=sample.prompt_tokens, frames=frames)


def test_collate_labels_masks_and_mm_ids(tok, ids):
    a = loaded(tok, 0, T=4, H=64, W=64, answer="[[0.0, 1.5], [2.0, 3.0]]")
    b = loaded(tok, 1, T=2, H=32, W=96, answer="[]")
    tensors, meta = collate([a, b], SPEC, **ids, repeat=[False, True])
    la, lb = len(a.input_ids), len(b.input_ids)
    L = max(la, lb)
    assert la != lb and tensors["input_ids"].shape == (2, L)
    for row, s, n in ((0, a, la), (1, b, lb)):
        x = tensors["input_ids"][row]
        assert x[:n].tolist() == s.input_ids and (x[n:] == ids["pad_token_id"]).all()
        assert tensors["attention_mask"][row].tolist() == [1] * n + [0] * (L - n)
        labels = tensors["labels"][row]
        assert (labels[: s.prompt_tokens] == IGNORE_INDEX).all() and (labels[n:] == IGNORE_INDEX).all()
        assert labels[s.prompt_tokens: n].tolist() == s.input_ids[s.prompt_tokens:]
        assert tok.decode(labels[s.prompt_tokens: n]) == s.record.answer + "<|im_end|>"
        mm = tensors["mm_token_type_ids"][row]
        is_pad = torch.tensor([t == ids["video_token_id"] for t in s.input_ids] + [False] * (L - n))
        assert (mm[is_pad] == 2).all() and (mm[~is_pad] == 0).all()
        assert int((mm == 2).sum()) == s.record.visual_tokens
    pa, pb = patchify(a.frames, SPEC)[0], patchify(b.frames, SPEC)[0]
    assert torch.equal(tensors["pixel_values_videos"], torch.cat([pa, pb]))
    assert tensors["video_grid_thw"].tolist() == [[2, 4, 4], [1, 2, 6]]
    assert meta.sample_ids == ["vid/w0000", "vid/w0001"] and meta.repeat == [False, True]
    assert meta.padded_tokens == 2 * L and meta.input_tokens == [la, lb]
    assert meta.supervised_tokens == [a.record.supervised_tokens, b.record.supervised_tokens]
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_collated_batch_runs_through_the_tiny_model(tok, ids, family):
    """The layout is what the model expects: M-RoPE accepts the grids, the vision tower the rows."""
    from transformers import AutoModelForImageTextToText

    from train.models import build_config, load_shape

    _, shape = load_shape(f"tiny_{family}")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(build_config(family, shape, tok)).eval()
    spec = VisionSpec.from_model_config(model.config)
    tensors, _ = collate([loaded(tok, 0), loaded(tok, 1, T=2, H=32, W=96, answer="[]")], spec, **ids)
    with torch.no_grad():
        out = model(**tensors)
    assert torch.isfinite(out.loss)


# ---------------------------------------------------------------------------------------------------------
# pre-flight


def test_preflight_passes_a_good_sample(tok, ids):
    s = loaded(tok, 0)
    preflight(s, tokenizer=tok, spec=SPEC, pixels=patchify(s.frames, SPEC)[0])
    preflight(s, spec=SPEC, video_token_id=ids["video_token_id"])


def test_preflight_catches_a_truncated_answer(tok):
    s = loaded(tok, 0, answer="[[0.0, 1.5], [2.0, 3.5]]")
    s.input_ids = s.input_ids[:-3]  # the end of the answer and <|im_end|> cut off
    with pytest.raises(PreflightError, match=r"sample vid/w0000: .*answer is truncated or altered"):
        preflight(s, tokenizer=tok)


def test_preflight_catches_a_misplaced_prompt_boundary(tok):
    s = loaded(tok, 0)
    s.prompt_tokens -= 1
    with pytest.raises(PreflightError, match="prompt_tokens does not mark where the answer starts"):
        preflight(s, tokenizer=tok)


def test_preflight_catches_a_wrong_pad_count(tok, ids):
    s = loaded(tok, 0)
    k = s.input_ids.index(ids["video_token_id"])
    s.input_ids[k] = tok.convert_tokens_to_ids("<|vision_end|>")
    with pytest.raises(PreflightError, match=r"sample vid/w0000: 7 video pad tokens in input_ids, grid \[2, 4, 4\] needs 2\*4\*4/4 = 8"):
        preflight(s, tokenizer=tok)


def test_preflight_catches_pixels_and_frames_off_grid(tok):
    s = loaded(tok, 0)
    with pytest.raises(PreflightError, match="16 pixel rows, grid .* needs 2\\*4\\*4 = 32"):
        preflight(s, pixels=torch.zeros(16, SPEC.patch_dim))
    s.frames = s.frames[:2]
    with pytest.raises(PreflightError, match="2 frames in the shard, the record says num_frames=4"):
        preflight(s)


def test_preflight_catches_no_supervision(tok):
    s = loaded(tok, 0)
    s.prompt_tokens = len(s.input_ids)
    with pytest.raises(PreflightError, match="sample vid/w0000: no supervised tokens"):
        preflight(s)


def test_preflight_records(tok):
    good = [make_sample(tok, i)[0].record for i in range(3)]
    preflight_records(good, max_input_tokens=1000)
    bad = [dataclasses.replace(r) for r in good]
    bad[1].visual_tokens += 1
    bad[2].supervised_tokens = 0
    with pytest.raises(PreflightError) as e:
        preflight_records(bad)
    msg = str(e.value)
    assert msg.startswith("2 of 3 planned samples fail pre-flight")
    assert "vid/w0001: visual_tokens 9, grid needs 8" in msg and "vid/w0002: no supervised tokens" in msg
    with pytest.raises(PreflightError, match=f"vid/w0000: {good[0].input_tokens} input tokens > limit 10"):
        preflight_records(good[:1], max_input_tokens=10)


# ---------------------------------------------------------------------------------------------------------
# loader


def test_rank_loader_keeps_plan_order_with_workers(tiny_build, tok, ids):
    root, _ = tiny_build
    store = SampleStore(root)
    order = [
        MicroBatch(sample_ids=["vid/w0003"], repeat=[False]),
        MicroBatch(sample_ids=["vid/w0001", "vid/w0000"], repeat=[False, False]),
        MicroBatch(sample_ids=["vid/w0002"], repeat=[False]),
        MicroBatch(sample_ids=["vid/w0000"], repeat=[True]),
        MicroBatch(sample_ids=["vid/w0002", "vid/w0003"], repeat=[False, True]),
    ]
    got = list(rank_loader(store, order, SPEC, **ids, tokenizer=tok, num_workers=2, prefetch_factor=1))
    assert [m.sample_ids for _, m in got] == [mb.sample_ids for mb in order]
    assert [m.repeat for _, m in got] == [mb.repeat for mb in order]
    direct, _ = collate([store.get("vid/w0001"), store.get("vid/w0000")], SPEC, **ids)
    for k, v in direct.items():
        assert torch.equal(got[1][0][k], v), k


@pytest.mark.parametrize("workers", [0, 1])
def test_rank_loader_names_a_bad_sample(tiny_build, tok, ids, workers):
    """In the trainer's process and out of a loader worker alike, the error keeps its type and fields (the
    DataLoader alone would turn a worker's exception into a RuntimeError around a traceback)."""
    root, written = tiny_build
    records = [dataclasses.replace(s.record) for s, _ in written.values()]
    store = SampleStore(root, records=records)
    # a store whose copy of the answer disagrees with the tokens: loading fails with the sample named
    store.records["vid/w0002"] = dataclasses.replace(store.records["vid/w0002"], answer="[[0.0, 0.5]]")
    with pytest.raises(SampleError) as e:
        list(rank_loader(store, [MicroBatch(sample_ids=["vid/w0002"], repeat=[False])], SPEC, **ids,
                         num_workers=workers))
    assert type(e.value) is SampleError and e.value.sample_id == "vid/w0002" and e.value.member.endswith(".json")
    assert str(e.value).startswith("sample vid/w0002: ") and "Traceback" not in str(e.value)
