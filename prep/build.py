"""`python -m prep build`: videos + annotations -> token-budgeted WebDataset shards + manifest.

The stages, each a small function (the worker below composes them per video):
    annotations.load_annotations -> probe.probe_video -> annotations.check_segments
    -> windows.make_windows -> answers.rebase_segments/format_answer        (parent: cheap, decides shards)
    -> plan_window (budget.plan_frames + schemas.prompt.tokenize_sample, frames lowered for --max-input-tokens)
    -> decode.decode_windows -> decode.encode_windows -> shards.ShardWriter (workers: one shard per task, a
       few tasks at once per worker process (worker_threads); each decodes its next window while its encode
       threads resize + JPEG the previous one)
Probes and shards run in worker processes (workers.distribute) under a watchdog: a video whose probe or
decode makes no progress for --decode-timeout seconds is rejected (decode_timeout), its worker replaced.
Every bad input becomes a RejectRecord with its stage, a machine reason and a human detail; code errors
crash. Resume: a rerun skips complete shards (shards.ShardPaths.incomplete); --overwrite rebuilds from scratch.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import ExitStack, closing
from pathlib import Path

from prep import answers as answers_mod
from prep.annotations import check_segments, load_annotations
from prep.budget import FPS_MAX_FRAMES, FPS_MIN_FRAMES, PATCH_SIZE, FramePlan, VideoBudget, group_times, plan_frames
from prep.decode import RESIZE, DecodeError, decode_windows, encode_windows, keep_freed_buffers, read_ahead
from prep.decoders import AUTO, AUTO_ORDER, BACKENDS, DECORD_EXACT_CODECS, DEFAULT_BACKEND, EXACT_FALLBACK, backend_for, resolve
from prep.decoders import available as decoder_available
from prep.outdir import (PLAN_FILE, BuildIOError, BuildLock, BuildLocked, Discard, discard_folders, io_stage,
                         our_files, part_lock_name, sweep_temps, tmp_name)
from prep.probe import ProbeFailure, ProbeResult, probe_video
from prep.shards import (INPUT_REJECTS, ShardOutput, ShardPaths, ShardWriter, assemble, file_entry, group_videos,
                         read_shard, read_stats, shard_name, shard_samples, write_stats)
from prep.windows import LAST_WINDOW, MIN_LAST_S, Window, make_windows
from prep.workers import Pool, Retry, distribute, heartbeat, loading
from schemas.annotations import FORMATS, Annotation, reject
from schemas.answer import DESCRIPTION as ANSWER_FORMAT
from schemas.answer import format_answer
from schemas.build import (
    BUILD_JSON,
    BuildRecord,
    BuildSummary,
    DecodeInfo,
    FileEntry,
    InputBound,
    PromptInfo,
    ShardFile,
    Throughput,
    Timings,
    TokenizerInfo,
)
from schemas.manifest import SCHEMA_VERSION, RejectRecord, SampleRecord, Segment, write_records
from schemas.prompt import (
    BUNDLED_TOKENIZER,
    DEFAULT_LAYOUT,
    DEFAULT_QUERY,
    LAYOUTS,
    TokenizedSample,
    control_tokens_in,
    load_tokenizer,
    special_id,
    tokenize_sample,
)
from schemas.shard import ShardSample, ids_sha256
from schemas.versions import package_versions

QVH_QUERY_TEMPLATE = (
    'Find every moment in the video that matches "{query}". Answer as JSON [[start, end], ...] '
    "in seconds from the start of the clip, or [] if there is none."
)
DECODE_TIMEOUT_S = 300.0  # a window of a long 4K video decodes in seconds; minutes without one is a hang
SPECIAL_TOKENS = ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>")


# exit codes of `prep build` (README lists them)
EXIT_NO_SAMPLE = 1  # every input was rejected
EXIT_CONFIG = 2  # BuildError: invalid flags, or --out holds a different build
EXIT_LOCKED = 3  # another live build holds --out (its pid, host and start time are named)
EXIT_IO = 4  # BuildIOError: no space, permission denied, read-only filesystem, ... (stage and path named)


class BuildError(RuntimeError):
    """A problem with the build as a whole (bad config, an out dir holding another build): exit 2."""


@dataclasses.dataclass(kw_only=True)
class BuildConfig:
    """Every knob of a build; validated up front, written to build.json verbatim."""

    videos: Path
    out: Path
    annotations: Path | None = None  # default: videos/annotations.jsonl
    format: str = "default"
    window_seconds: float = 16.0
    stride_seconds: float | None = None  # default: window_seconds
    last_window: str = "keep"
    min_window_seconds: float = MIN_LAST_S
    min_segment_seconds: float = answers_mod.MIN_SEGMENT_S
    negatives: str = "keep"
    fps: float = 2.0
    max_frames: int = FPS_MAX_FRAMES  # frames per window at most (qwen-vl-utils' FPS_MAX_FRAMES)
    model_family: str = "qwen3_vl"
    video_min_tokens: int | None = None  # None: VIDEO_MIN_TOKEN_NUM or the default
    video_max_tokens: int | None = None  # None: VIDEO_MAX_TOKEN_NUM or the default
    max_input_tokens: int | None = None  # None: the model's own maximum (input_bound)
    tokenizer: Path | None = None  # None: the bundled tokenizer
    allow_outside_videos: bool = False  # read annotation paths that resolve outside --videos
    prompt_layout: str = DEFAULT_LAYOUT  # schemas.prompt.LAYOUTS: nested (transformers 5.x) or flat (4.57 / vLLM)
    query: str = DEFAULT_QUERY
    query_template: str | None = None  # None: "{query}" (qvhighlights: QVH_QUERY_TEMPLATE)
    jpeg_quality: int = 95
    decoder: str = DEFAULT_BACKEND  # prep/decoders.py: auto | decord | torchcodec | pyav; auto resolved at once
    samples_per_shard: int | None = None  # None: prep.shards.shard_samples picks it from the build's windows
    shard_size_mb: float | None = 1024.0
    workers: int | None = None  # None: all cores available to this process (--ray: shard tasks in flight, None: no cap)
    decode_timeout: float = DECODE_TIMEOUT_S  # seconds a decode may go without progress; 0: no watchdog
    ray: str | None = None  # None: local worker processes; "" or an address: shards as Ray tasks (prep/ray_distributor.py)
    part: str | None = None  # "K/N": build only the shards of part K of N (no manifest; --assemble afterwards)
    assemble: bool = False  # build no shard: check every shard complete, write manifest/rejects/build.json
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        self.videos, self.out = Path(self.videos), Path(self.out)
        self.annotations = Path(self.annotations) if self.annotations else self.videos / "annotations.jsonl"
        self.tokenizer = Path(self.tokenizer) if self.tokenizer else None
        if self.stride_seconds is None:
            self.stride_seconds = self.window_seconds
        if self.query_template is None:
            self.query_template = QVH_QUERY_TEMPLATE if self.format == "qvhighlights" else "{query}"
        self.decoder = resolve(self.decoder)  # build.json, the fingerprint and every worker see the one that decodes
        if self.workers is None and self.ray is None:
            self.workers = _cores()

    def problems(self) -> list[str]:
        """Everything wrong with this config at once (empty when valid)."""
        p = []
        if not self.videos.is_dir():
            p.append(f"--videos {self.videos} is not a directory")
        if not self.annotations.exists():
            p.append(f"--annotations {self.annotations} does not exist")
        if self.format not in FORMATS:
            p.append(f"--format must be one of {FORMATS}, got {self.format!r}")
        if self.window_seconds <= 0 or self.stride_seconds <= 0:
            p.append("--window-seconds and --stride-seconds must be > 0")
        if self.last_window not in LAST_WINDOW:
            p.append(f"--last-window must be one of {LAST_WINDOW}")
        if self.min_segment_seconds < 0:
            p.append("--min-segment-seconds must be >= 0")
        if self.negatives not in ("keep", "drop"):
            p.append("--negatives must be keep or drop")
        if self.fps <= 0:
            p.append("--fps must be > 0")
        if self.max_frames < FPS_MIN_FRAMES:
            p.append(f"--max-frames must be >= {FPS_MIN_FRAMES}, got {self.max_frames}")
        if self.model_family not in PATCH_SIZE:
            p.append(f"--model-family must be one of {sorted(PATCH_SIZE)}")
        if self.max_input_tokens is not None and self.max_input_tokens <= 0:
            p.append("--max-input-tokens must be > 0")
        if not 1 <= self.jpeg_quality <= 100:
            p.append("--jpeg-quality must be in 1..100")
        if self.decoder not in BACKENDS:
            p.append(f"--decoder must be one of {BACKENDS}, got {self.decoder!r}")
        elif why := decoder_available(self.decoder):
            p.append(why)
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            p.append("--samples-per-shard must be >= 1")
        if self.workers is not None and self.workers < 1:
            p.append("--workers must be >= 1")
        if self.part is not None:
            if self.part_of() is None:
                p.append(f"--part must be K/N with 1 <= K <= N, got {self.part!r}")
            if self.overwrite:
                p.append("--part cannot --overwrite (it would delete the other parts' shards): empty --out first")
            if self.assemble:
                p.append("--assemble takes no --part: it runs once, after every part")
        if self.ray is not None and importlib.util.find_spec("ray") is None:
            p.append("--ray needs Ray installed here and on every node: pip install 'video-ora[ray]'")
        if self.assemble and self.overwrite:
            p.append("--assemble builds nothing, so it cannot --overwrite")
        if not self.decode_timeout >= 0:
            p.append("--decode-timeout must be >= 0 (0: no watchdog)")
        if "{query}" not in self.query_template:
            p.append("--query-template must contain {query}")
        if self.prompt_layout not in LAYOUTS:
            p.append(f"--prompt-layout must be one of {sorted(LAYOUTS)}, got {self.prompt_layout!r}")
        if self.tokenizer is not None and not (self.tokenizer / "tokenizer.json").is_file():
            p.append(f"--tokenizer {self.tokenizer} has no tokenizer.json")
        else:  # an annotation's own query is checked with its samples (query_control_token rejects)
            tokenizer = load_tokenizer(str(self.tokenizer) if self.tokenizer else None)
            for flag, text in (("--query", self.query), ("--query-template", self.query_template)):
                if found := control_tokens_in(tokenizer, text):
                    p.append(f"{flag} writes {', '.join(found)}, which the tokenizer reads as control token(s), not "
                             f"text: every prompt would change; remove them")
        try:
            self.budget()
        except ValueError as e:
            p.append(str(e))
        return p

    def part_of(self) -> tuple[int, int] | None:
        """(K, N) of --part K/N; None when absent or malformed."""
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", self.part or "")
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            return None
        return int(m.group(1)), int(m.group(2))

    def budget(self) -> VideoBudget:
        return VideoBudget.from_env(
            model_family=self.model_family,
            video_min_tokens=self.video_min_tokens,
            video_max_tokens=self.video_max_tokens,
            fps=self.fps,
            max_frames=self.max_frames,
        )

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}

    def fingerprint(self) -> str:
        """What decides the content of the shards (not where they are, how they are distributed, the watchdog,
        progress, overwrite)."""
        keep = {k: v for k, v in self.to_json().items()
                if k not in ("out", "workers", "decode_timeout", "overwrite", "progress", "ray", "part", "assemble",
                             "max_frames")}  # max_frames is in the budget below (an old build keeps its fingerprint)
        keep["budget"] = dataclasses.asdict(self.budget())
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowJob:
    window: Window
    segments: list[Segment]  # window-local, as rendered in answer
    answer: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class VideoJob:
    """One annotated, probed video with its windows decided: what a worker needs, picklable."""

    video_id: str
    source_path: str
    query: str
    probe: ProbeResult
    windows: list[WindowJob]
    negatives_dropped: int = 0  # windows left out by --negatives drop (counted, not rejects)
    share: float = 1.0  # fraction of the video's windows in this job (< 1: a long video split over shards)

    @property
    def label(self) -> str:
        """How the shard plan names this job: the id, plus the window range of a piece of a split video."""
        if self.share == 1.0:
            return self.video_id
        return f"{self.video_id}@w{self.windows[0].window.index}-{self.windows[-1].window.index}"


# transformers' stand-in for "no maximum" in model_max_length is int(1e30); anything this large means unset
_UNSET_MAX = 10**12


def input_bound(max_input_tokens: int | None, tokenizer: Path | None) -> InputBound:
    """--max-input-tokens, else the model's own maximum: the smaller of the tokenizer's model_max_length and
    the max_position_embeddings of a config.json next to it (a model directory), when they are set. A
    sample over it could not be trained on anyway; without a bound a 10 MB query made a 7M-token sample."""
    if max_input_tokens is not None:
        return InputBound(tokens=max_input_tokens, source="--max-input-tokens")
    found = []
    declared = getattr(load_tokenizer(str(tokenizer) if tokenizer else None), "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < _UNSET_MAX:
        found.append((declared, "tokenizer model_max_length"))
    config = Path(tokenizer or BUNDLED_TOKENIZER) / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        for where in (data, data.get("text_config") or {}):
            positions = where.get("max_position_embeddings")
            if isinstance(positions, int) and positions > 0:
                found.append((positions, "config.json max_position_embeddings"))
                break
    if not found:
        return InputBound(tokens=None, source="none declared by the tokenizer or config.json")
    tokens, source = min(found)
    return InputBound(tokens=tokens, source=source)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    budget: VideoBudget
    tokenizer: str | None
    bound: InputBound
    prompt_layout: str
    jpeg_quality: int
    decoder: str  # prep/decoders.py backend
    decode_timeout: float  # --decode-timeout, for the reject detail (the parent's watchdog enforces it)
    decode_threads: int  # decord threads per worker process
    encode_threads: int  # resize + JPEG threads per worker process, running while the decoder works


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardTask:
    index: int
    out: Path
    videos: list[VideoJob]
    settings: WorkerSettings
    timed_out: tuple[str, ...] = ()  # probe paths whose decode stalled: rejected, not opened again

    @property
    def paths(self) -> ShardPaths:
        return ShardPaths(self.out, shard_name(self.index))


# ----------------------------------------------------------------------------------------------- stages


def plan_video(ann: Annotation, probe: ProbeResult, config: BuildConfig) -> VideoJob | RejectRecord:
    """Segments checked against the probe, windows cut, answers rendered; a reject when nothing remains."""
    checked = check_segments(ann, probe.duration_s)
    if isinstance(checked, RejectRecord):
        return checked
    windows = make_windows(probe.duration_s, config.window_seconds, config.stride_seconds, config.last_window,
                           config.min_window_seconds)
    if not windows:
        return reject(ann.video_id, ann.source_path, "no_windows",
                      f"{probe.duration_s:.2f} s video gives no window with --window-seconds {config.window_seconds:g} "
                      f"--last-window {config.last_window} (a partial window needs >= {config.min_window_seconds:g} s)",
                      stage="windows")
    jobs = []
    for w in windows:
        segs = answers_mod.rebase_segments(checked.segments, w.start_s, w.end_s, config.min_segment_seconds)
        if not segs and config.negatives == "drop":
            continue
        jobs.append(WindowJob(window=w, segments=segs, answer=format_answer(segs)))
    if not jobs:
        return reject(ann.video_id, ann.source_path, "no_positive_windows",
                      f"all {len(windows)} windows are negatives and --negatives drop", stage="answers")
    query = config.query_template.replace("{query}", ann.query) if ann.query else config.query
    return VideoJob(video_id=ann.video_id, source_path=ann.source_path, query=query, probe=probe, windows=jobs,
                    negatives_dropped=len(windows) - len(jobs))


class WindowRejected(Exception):
    def __init__(self, stage: str, reason: str, detail: str):
        super().__init__(detail)
        self.stage, self.reason, self.detail = stage, reason, detail


def plan_window(budget: VideoBudget, probe: ProbeResult, job: WindowJob, tokenizer, query: str,
                bound: InputBound, layout: str) -> tuple[FramePlan, list[float], TokenizedSample]:
    """Frames, prompt times and tokens of one window; the frame count is lowered (largest even count
    that fits, found by bisection) when the sample exceeds the bound. The answer is never cut."""
    w = job.window
    max_input_tokens = bound.tokens

    def attempt(max_frames: int | None):
        try:
            plan = plan_frames(budget, height=probe.height, width=probe.width, fps=probe.fps,
                               total_frames=probe.frames, start_s=w.start_s, end_s=w.end_s, max_frames=max_frames)
        except ValueError as e:
            raise WindowRejected("budget", "window_frames", f"window {w.index} ({w.start_s:.2f}-{w.end_s:.2f} s): {e}") from e
        times = group_times([i / probe.fps for i in plan.frame_indices], w.start_s)
        tok = tokenize_sample(tokenizer, query=query, answer=job.answer, group_times_s=times,
                              tokens_per_group=plan.tokens_per_group, layout=layout)
        return plan, times, tok

    full = attempt(None)
    if max_input_tokens is None or len(full[2].input_ids) <= max_input_tokens:
        return full
    lo, hi, best = 1, full[0].grid_t - 1, None  # counted in temporal groups (2 frames each)
    while lo <= hi:
        mid = (lo + hi) // 2
        got = attempt(2 * mid)
        if len(got[2].input_ids) <= max_input_tokens:
            best, lo = got, mid + 1
        else:
            hi = mid - 1
    if best is None:
        two = attempt(2)
        raise WindowRejected("budget", "over_token_budget",
                             f"window {w.index} ({w.start_s:.2f}-{w.end_s:.2f} s): even 2 frames need "
                             f"{len(two[2].input_ids)} tokens ({two[2].visual_tokens} visual) > {bound}; "
                             f"{len(full[2].input_ids)} at the full {len(full[0].frame_indices)} frames")
    return best


def sample_key(video_id: str, window_index: int) -> str:
    """WebDataset key: no dots or slashes (webdataset splits on them)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", video_id)[:120] + f"_w{window_index:04d}"


# ----------------------------------------------------------------------------------------------- worker

def probe_one(path: str) -> ProbeResult | ProbeFailure:
    """The probe as a worker task (the watchdog bounds it like a decode)."""
    heartbeat(path)
    try:
        return probe_video(path)
    except Exception as e:  # a bad file is a ProbeFailure; this is a code error: it stops the build, named
        e.add_note(f"prep build: probing {path}")
        raise


def process_shard(task: ShardTask) -> dict:
    """Build one shard from scratch: plan, tokenize, decode each file once, write; stats.json last.
    A file in task.timed_out (its decode hung in an earlier attempt) is not opened: its windows are rejects."""
    paths = task.paths
    _one_torch_thread()
    keep_freed_buffers()
    with io_stage("write shard", paths.tar):
        paths.clear()
        writer = ShardWriter(paths)
    s = task.settings
    tokenizer = load_tokenizer(s.tokenizer)
    records: list[SampleRecord] = []
    rejects: list[RejectRecord] = []
    keys: set[str] = set()
    t = Counter()
    try:
        with io_stage("write shard", writer.tmp), ThreadPoolExecutor(s.encode_threads, thread_name_prefix="encode") as pool:
            for file_jobs in _by_file(task.videos):
                if file_jobs[0].probe.path in task.timed_out:
                    _reject_timed_out(file_jobs, s.decode_timeout, rejects, t)
                    continue
                try:
                    _process_file(file_jobs, s, tokenizer, pool, writer, records, rejects, keys, t)
                except Exception as e:  # a bad file is a reject; this is a code error: it stops the build, named
                    e.add_note(f"prep build: in {paths.name}, on {file_jobs[0].probe.path} "
                               f"(annotations {', '.join(j.label for j in file_jobs)})")
                    raise
        with io_stage("write sidecars", paths.samples):
            write_records(paths.samples, records, SampleRecord)
            write_records(paths.rejects, rejects, RejectRecord)
        with io_stage("write shard", writer.tmp):
            sha, size = writer.commit()  # the tar gets its final name only after its sidecars exist
    except BaseException:
        writer.abort()
        raise
    with io_stage("write sidecars", paths.samples):
        sidecars = {kind: file_entry(path) for kind, path in paths.sidecars().items()}
    stats = {"shard": paths.tar.name, "sha256": sha, "bytes": size, "samples": len(records), "rejects": len(rejects),
             "sidecars": sidecars,
             "videos": len(task.videos), "video_ids": [v.video_id for v in task.videos],
             **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}}
    with io_stage("write stats", paths.stats):
        write_stats(paths, stats)
    return stats


def warm_shard_worker(task: ShardTask) -> None:
    """What a process that forks shard workers loads once, so each fork starts warm (a Ray worker does it here;
    a local build warms its parent before the pool forks: warm_before_fork): tokenizer, decoder, resize, JPEG.
    Without it each Ray task's child paid ~1-2 CPU s of first calls (measured on the 2-core box)."""
    import numpy as np

    from prep.decode import encode_frame

    warm_before_fork(task.settings.tokenizer, task.settings.prompt_layout)
    encode_frame(np.zeros((36, 64, 3), np.uint8), 32, 48, task.settings.jpeg_quality)  # torch's resize kernels too
    if task.settings.decoder == "torchcodec":  # decord and PyAV: warm_before_fork imports them (the probe's)
        from torchcodec.decoders import VideoDecoder  # noqa: F401


def warm_before_fork(tokenizer: str | None, layout: str) -> None:
    """First calls every shard worker makes, done once in the process its workers are forked from: loading the
    tokenizer, compiling its chat template, pyarrow's first from_pylist (imports pandas, 0.5 s), importing the
    probe's decord and PyAV (a forked process's first probe costs ~190 ms of CPU when it imports av itself, ~60 ms
    when the parent did: 2-core box, BENCHMARKS.md, Prep, session 16). Nothing here starts a
    thread (torch's resize is warmed in the workers: its thread pool must not exist before a fork). torch itself is
    imported here, once for every worker (~1 s of CPU each on the 2-core box otherwise): the modules that use it
    import it where they call it, so that `--help`, `prep inspect` and the parent's planning do not pay for it."""
    import av  # noqa: F401
    import decord  # noqa: F401
    import torch  # noqa: F401

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as in the build's own process (forks follow)
    tok = load_tokenizer(tokenizer)
    tokenize_sample(tok, query="warm-up", answer="[]", group_times_s=[0.0], tokens_per_group=4, layout=layout)
    import pyarrow as pa

    from schemas.manifest import arrow_schema

    pa.Table.from_pylist([], schema=arrow_schema(RejectRecord))


def _one_torch_thread() -> None:
    """The resize (prep/decode.py) runs on the encode threads; torch's own intra-op pool would oversubscribe
    the cores the other workers use. Called in worker processes only (the parent's torch stays as it is)."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _by_file(videos: list[VideoJob]) -> list[list[VideoJob]]:
    """Annotations grouped by the file they name (QVHighlights has several queries per video), in order."""
    groups: dict[str, list[VideoJob]] = {}
    for v in videos:
        groups.setdefault(v.probe.path, []).append(v)
    return list(groups.values())


def _reject_timed_out(jobs: list[VideoJob], timeout_s: float, rejects: list[RejectRecord], t: Counter) -> None:
    for video in jobs:
        for job in video.windows:
            w = job.window
            rejects.append(reject(video.video_id, video.source_path, "decode_timeout",
                                  f"window {w.index} ({w.start_s:.2f}-{w.end_s:.2f} s) not written: decoding "
                                  f"{Path(video.probe.path).name} made no progress for --decode-timeout {timeout_s:g} s "
                                  f"(its worker was killed and replaced)", stage="decode"))
    t["videos"] += len(jobs)
    heartbeat(jobs[0].probe.path, progress=(tuple(j.label for j in jobs), len(jobs), 0, 0.0))


def _process_file(jobs: list[VideoJob], s: WorkerSettings, tokenizer, pool: Executor, writer: ShardWriter,
                  records: list[SampleRecord], rejects: list[RejectRecord], keys: set[str], t: Counter) -> None:
    """Every window of every annotation of one file, decoded in one forward pass over the file."""
    heartbeat(jobs[0].probe.path)  # from here on the watchdog times this file
    t0 = time.perf_counter()
    planned = []
    for video in jobs:
        refusal = _query_refusal(video.query, tokenizer, s.bound)
        for job in video.windows:
            if refusal:
                w = job.window
                rejects.append(reject(video.video_id, video.source_path, refusal[0],
                                      f"window {w.index} ({w.start_s:.2f}-{w.end_s:.2f} s): {refusal[1]}", stage="tokens"))
                continue
            try:
                planned.append((video, job, *plan_window(s.budget, video.probe, job, tokenizer, video.query, s.bound,
                                                          s.prompt_layout)))
            except WindowRejected as r:
                rejects.append(reject(video.video_id, video.source_path, r.reason, r.detail, stage=r.stage))
    planned.sort(key=lambda p: p[1].window.start_s)  # stable: one annotation's windows keep their order
    t["plan_s"] += time.perf_counter() - t0
    done = 0
    probe = jobs[0].probe
    if planned:
        indices = [p[2].frame_indices for p in planned]
        sizes = [(p[2].height, p[2].width) for p in planned]
        decoded = read_ahead(_timed(decode_windows(probe.path, indices, backend=backend_for(s.decoder, probe.codec),
                                                   num_threads=s.decode_threads, rotation=probe.rotation),
                                    t, "decode_s", beat=probe.path))
        windows = encode_windows(decoded, sizes, s.jpeg_quality, pool)
        t0 = time.perf_counter()
        try:
            for pos, jpegs, encode_s in windows:
                t["encode_s"] += encode_s
                video, job, plan, times, tok = planned[pos]
                key = sample_key(video.video_id, job.window.index)
                if key in keys:
                    key += "_" + hashlib.sha1(video.video_id.encode()).hexdigest()[:8]
                keys.add(key)
                record = _record(video, job, plan, times, tok, writer.paths.tar.name, key, jpegs, s.prompt_layout)
                writer.add(ShardSample(record=record, input_ids=tok.input_ids, prompt_tokens=tok.prompt_tokens), jpegs)
                records.append(record)
                done += 1
                t["frames"] += len(jpegs)
        except DecodeError as e:
            for video, job, *_ in planned[done:]:
                rejects.append(reject(video.video_id, video.source_path, "decode_error",
                                      f"window {job.window.index} ({job.window.start_s:.2f}-{job.window.end_s:.2f} s) "
                                      f"not written: {e}", stage="decode"))
        t["pipeline_s"] += time.perf_counter() - t0  # decode, encode and write overlapped: < decode_s + encode_s
    t["videos"] += len(jobs)
    t["windows"] += done
    t["source_s"] += probe.duration_s * jobs[0].share
    heartbeat(probe.path, progress=(tuple(j.label for j in jobs), len(jobs), done, probe.duration_s * jobs[0].share))


def _query_refusal(query: str, tokenizer, bound: InputBound) -> tuple[str, str] | None:
    """(reason, detail) when no window can take this query, None when one might: it writes a control token of the
    tokenizer, or the query alone is over the bound. Checked once per annotation, so a huge query costs one
    tokenization, not one per window and attempt."""
    found = control_tokens_in(tokenizer, query)
    if found:
        return "query_control_token", (f"the query writes {', '.join(found)}, which the tokenizer reads as control "
                                       f"token(s), not text: the prompt would change (a turn ended, a video pad "
                                       f"added); remove them from the query")
    if bound.tokens is None:
        return None
    n = len(tokenizer(query, add_special_tokens=False, verbose=False)["input_ids"])
    if n <= bound.tokens:
        return None
    return "over_token_budget", f"the query alone has {n} tokens ({len(query)} characters) > {bound}"


def _timed(items: Iterator, t: Counter, key: str, beat: str) -> Iterator:
    """Pass items through, adding the seconds spent producing them to t[key]; each item is a heartbeat
    for `beat` (a decoded window is the progress the watchdog waits for)."""
    while True:
        t0 = time.perf_counter()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            t[key] += time.perf_counter() - t0
        heartbeat(beat)
        yield item


def _record(video: VideoJob, job: WindowJob, plan: FramePlan, times: list[float], tok: TokenizedSample,
            shard: str, key: str, jpegs: list[bytes], layout: str) -> SampleRecord:
    probe = video.probe
    return SampleRecord(
        sample_id=f"{video.video_id}/w{job.window.index:04d}",
        video_id=video.video_id,
        source_path=video.source_path,
        source_fps=probe.fps,
        source_frames=probe.frames,
        source_width=probe.width,
        source_height=probe.height,
        source_codec=probe.codec,
        source_rotation=probe.rotation,
        window_index=job.window.index,
        window_start_s=job.window.start_s,
        window_end_s=job.window.end_s,
        num_frames=len(plan.frame_indices),
        frame_indices=list(plan.frame_indices),
        frame_times_s=[i / probe.fps for i in plan.frame_indices],
        group_times_s=times,
        height=plan.height,
        width=plan.width,
        grid_t=plan.grid_t,
        grid_h=plan.grid_h,
        grid_w=plan.grid_w,
        visual_tokens=tok.visual_tokens,
        text_tokens=tok.text_tokens,
        supervised_tokens=tok.supervised_tokens,
        input_tokens=len(tok.input_ids),
        prompt_layout=layout,
        query=video.query,
        answer=job.answer,
        segments=list(job.segments),
        shard=shard,
        key=key,
        frame_sha256=[hashlib.sha256(b).hexdigest() for b in jpegs],
        input_ids_sha256=ids_sha256(tok.input_ids),
    )


# ----------------------------------------------------------------------------------------------- driver


def split_long_videos(units: dict[str, list[VideoJob]], samples_per_shard: int) -> dict[str, list[VideoJob]]:
    """A file with one annotation and more windows than a shard holds becomes pieces of consecutive windows
    (as equal as possible, each <= samples_per_shard), each its own unit: a long video then spans several
    shards, which run on several workers, instead of keeping one worker busy while the others idle. A piece
    is decoded from its first window's keyframe on (one extra GOP per piece). Files with several annotations
    (QVHighlights queries) stay whole: they are decoded once for all of them."""
    out: dict[str, list[VideoJob]] = {}
    for key, js in units.items():
        n = len(js[0].windows)
        if len(js) > 1 or n <= samples_per_shard:
            out[key] = js
            continue
        pieces = -(-n // samples_per_shard)
        bounds = [round(i * n / pieces) for i in range(pieces + 1)]
        for p, (a, b) in enumerate(zip(bounds, bounds[1:])):
            out[f"{key}#{p}"] = [dataclasses.replace(js[0], windows=js[0].windows[a:b], share=(b - a) / n,
                                                     negatives_dropped=js[0].negatives_dropped if p == 0 else 0)]
    return out


def _decode_weight(task: ShardTask) -> float:
    """What decoding a shard roughly costs (source seconds x pixels), to start the largest shards first; the
    order of work only: each shard's content and name are fixed by the plan."""
    return sum((w.window.end_s - w.window.start_s) * v.probe.width * v.probe.height
               for v in task.videos for w in v.windows)


def _estimate_bytes(job: VideoJob, budget: VideoBudget) -> int:
    """Rough tar bytes of a video (JPEG ~ 1/10 of raw RGB), for --shard-size-mb; a plan without tokens."""
    w, p = job.windows[0].window, job.probe
    try:
        plan = plan_frames(budget, height=p.height, width=p.width, fps=p.fps, total_frames=p.frames,
                           start_s=w.start_s, end_s=w.end_s)
    except ValueError:
        return 0  # only an estimate: the worker plans the window again and records the reject with its reason
    return len(job.windows) * len(plan.frame_indices) * plan.height * plan.width * 3 // 10


def _tokenizer_info(path: Path | None) -> TokenizerInfo:
    root = Path(path or BUNDLED_TOKENIZER)
    tok = load_tokenizer(str(path) if path else None)
    return TokenizerInfo(
        path=str(root),
        bundled=path is None,
        tokenizer_json_sha256=hashlib.sha256((root / "tokenizer.json").read_bytes()).hexdigest(),
        special_token_ids={t: special_id(tok, t) for t in SPECIAL_TOKENS},
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThreadSplit:
    """How one worker process spends its cores (worker_threads says why)."""

    streams: int  # shard tasks the process runs at once, each in a thread (prep.workers.distribute streams=)
    decode: int  # decoder threads of each stream
    encode: int  # resize + JPEG threads of each stream


def worker_threads(workers: int, tasks: int | None = None) -> ThreadSplit:
    """The thread split of each of `workers` processes over the cores left to it, for `tasks` shard tasks.

    resize + JPEG q95 costs ~1/4 of decoding a 30 fps H.264 source at 2 fps (measured on the 2-core box:
    1.4 ms per 640x352 frame next to ~6 ms of decoding per sampled frame), so a quarter of a worker's cores
    (at least one thread) encode and the rest decode; the main thread of each stream writes its tar beside them.
    One video's decoder does not scale with threads: decord on the 16-core host decoded 32 clips in 10.5 s with
    12 threads in one process and in 1.9 s with one thread in each of 16 (BENCHMARKS.md, Prep, session 7), so a
    worker decodes several videos at once instead: one stream per decoding core, each with one decoder thread
    (threads of one process: decord, PyAV, torchcodec and the resize + JPEG release the GIL while they work, and
    two decoding threads kept up with two processes on the 2-core box; BENCHMARKS.md, Prep). With fewer tasks than that (one long
    video, a small build) the streams it cannot fill become decoder threads of the ones it runs. On the 2-core box
    one worker runs 2 streams of 1 + 1 threads; with more workers than cores each gets one stream of 1 + 1 (the
    encoder mostly waits). Thread counts never change what a shard holds (tests/test_prep_build.py).
    """
    per_worker = max(1, _cores() // workers)
    encode = max(1, per_worker // 4)
    decode_cores = max(1, per_worker - per_worker // 4)
    # the most tasks one process can be given at once: its share of them, rounded up
    streams = decode_cores if tasks is None else max(1, min(decode_cores, -(-tasks // workers)))
    return ThreadSplit(streams=streams, decode=max(1, (per_worker - encode) // streams),
                       encode=max(1, encode // streams))


def _thread_split(config: BuildConfig, tasks: int) -> ThreadSplit:
    """worker_threads for a local build; one stream under --ray: a Ray task gets one CPU (one decoder thread +
    one encode thread, as a local worker on a full machine)."""
    if config.ray is not None:
        return ThreadSplit(streams=1, decode=1, encode=1)
    return worker_threads(config.workers, tasks)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build(config: BuildConfig) -> dict:
    """Run a whole build under the lock on --out; returns the summary that also goes into build.json."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with loading():  # the decoder (problems() imports it), the tokenizer and what every worker calls first
        problems = config.problems()
        if not problems:
            warm_before_fork(str(config.tokenizer) if config.tokenizer else None, config.prompt_layout)
    if problems:
        raise BuildError("invalid build config:\n  " + "\n  ".join(problems))
    part = config.part_of()
    # held until build.json is written (BuildLocked when another build has it); a part shares the build's
    # lock with the other parts and holds its own part lock alone
    locks = [BuildLock(config.out, shared=part is not None)]
    if part is not None:
        locks.append(BuildLock(config.out, name=part_lock_name(*part)))
    held = []
    try:
        for lock in locks:
            with io_stage("lock", lock.path):
                config.out.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            held.append(lock)
            if lock.previous is not None:
                print(f"prep build: took over {lock.path} from {lock.previous}: that build ended without releasing "
                      f"it (killed?); its unfinished shards are rebuilt", file=sys.stderr)
        # any OS error a named stage below did not catch; the probes' processes build the shards too (one
        # fork round), the pool stops them at the end
        with io_stage("build", config.out), Pool() as pool, ExitStack() as on_exit:
            return _build_locked(config, pool, on_exit)
    finally:
        for lock in reversed(held):
            lock.release()


def _build_locked(config: BuildConfig, pool: Pool, on_exit: ExitStack) -> dict:
    t_start = time.perf_counter()
    out = config.out
    part = config.part_of()
    with io_stage("clean", out):
        if part is None:  # (--overwrite is refused with --part)
            sweep_temps(out)  # partial files of a dead build: no other build can be writing here now
            old = discard_folders(out) + (our_files(out) if config.overwrite else [])
            if old:
                on_exit.enter_context(Discard(out, old))  # deleted while this build runs
    budget = config.budget()
    tok_info = _tokenizer_info(config.tokenizer)  # fails fast on a tokenizer without the Qwen-VL tokens

    bound = input_bound(config.max_input_tokens, config.tokenizer)
    with io_stage("annotations", config.annotations):
        anns, input_rejects = load_annotations(config.annotations, config.videos, config.format,
                                               allow_outside=config.allow_outside_videos)
    # probes and shards run in worker processes (prep/workers.py), forked before any decoder runs here
    t0 = time.perf_counter()
    setup_s = t0 - t_start
    paths = sorted({a.source_path for a in anns})
    videos_dir = config.videos.absolute()  # the same path on every node of a cluster (a shared filesystem)
    with io_stage("probe", config.videos):
        probes = dict(zip(paths, _probe_all([str(videos_dir / p) for p in paths], config, pool)))
    t_plan = time.perf_counter()
    probe_s = t_plan - t0

    jobs: list[VideoJob] = []
    for ann in anns:
        probe = probes[ann.source_path]
        if isinstance(probe, ProbeFailure):
            input_rejects.append(reject(ann.video_id, ann.source_path, probe.reason, probe.detail, stage=probe.stage))
            continue
        job = plan_video(ann, probe, config)
        (input_rejects if isinstance(job, RejectRecord) else jobs).append(job)
    jobs.sort(key=lambda j: j.video_id)
    # the unit of grouping is a file with all its annotations (sorted by their first id), so a file
    # shared by several annotations is decoded once
    units: dict[str, list[VideoJob]] = {}
    for j in jobs:
        units.setdefault(j.source_path, []).append(j)
    samples_per_shard = shard_samples(sum(len(j.windows) for j in jobs), config.samples_per_shard)
    units = split_long_videos(units, samples_per_shard)
    shard_bytes = int(config.shard_size_mb * 2**20) if config.shard_size_mb else None
    unit_groups = group_videos([(key, sum(len(j.windows) for j in js), sum(_estimate_bytes(j, budget) for j in js))
                                for key, js in units.items()], samples_per_shard, shard_bytes)
    groups = [[j.label for key in g for j in units[key]] for g in unit_groups]
    with io_stage("plan", out / PLAN_FILE):
        _check_plan(out, config, groups)
        write_records(out / INPUT_REJECTS, input_rejects, RejectRecord)

    shard_paths = [ShardPaths(out.absolute(), shard_name(i)) for i in range(len(unit_groups))]
    # --part K/N: every K-th shard (round robin: long and short videos spread over the parts)
    mine = [i for i in range(len(unit_groups)) if part is None or i % part[1] == part[0] - 1]
    if part is not None:
        with io_stage("clean", out):  # only this part's own stale temps: the other parts may be writing theirs
            sweep_temps(out, tuple(shard_paths[i].name + "." for i in mine))
    todo = []
    for i in mine:
        why = shard_paths[i].incomplete()
        if why is None:
            continue
        if shard_paths[i].stats.is_file():  # looked complete: say why it is rebuilt instead of trusting it
            print(f"prep build: rebuilding {shard_paths[i].name}: {why}", file=sys.stderr)
        todo.append(i)  # process_shard clears what is left of it, stats first
    if config.assemble and todo:
        names = ", ".join(f"{shard_paths[i].name} ({shard_paths[i].incomplete()})" for i in todo[:5])
        raise BuildError(f"--assemble: {len(todo)} of {len(unit_groups)} shards are not complete: {names}"
                         f"{', ...' if len(todo) > 5 else ''}; finish their --part builds (or run this command "
                         f"without --assemble to build them here)")

    split = _thread_split(config, len(todo))
    settings = WorkerSettings(budget=budget, tokenizer=str(config.tokenizer) if config.tokenizer else None,
                              bound=bound, prompt_layout=config.prompt_layout, jpeg_quality=config.jpeg_quality,
                              decoder=config.decoder, decode_timeout=config.decode_timeout,
                              decode_threads=split.decode, encode_threads=split.encode)
    tasks = [ShardTask(index=i, out=out.absolute(), videos=[j for key in g for j in units[key]], settings=settings)
             for i, g in enumerate(unit_groups)]
    mine, pending = [tasks[i] for i in mine], [tasks[i] for i in todo]
    pending.sort(key=_decode_weight, reverse=True)  # largest first: the last shards to start are the short ones
    t0 = time.perf_counter()
    plan_s = t0 - t_plan
    with io_stage("shards", out):  # the workers name their own stage and file (write shard, sidecars, stats)
        built = _run_shards(pending, config, pool, split.streams)
    shards_s = time.perf_counter() - t0
    with io_stage("clean", out):  # temps of attempts that were killed and retried (a Ray task, a stalled worker)
        sweep_temps(out, None if part is None else tuple(t.paths.name + "." for t in mine))
    if part is not None:
        return _part_summary(config, tasks, mine, pending, probe_s, shards_s, time.perf_counter() - t_start)

    t0 = time.perf_counter()
    with io_stage("assemble", out / "manifest.parquet"):
        shards = [built.get(t.paths.name) or read_shard(t.paths) for t in tasks]  # an earlier run's: read now
        samples, rejects = assemble(out, shards)
    stats = [s.stats for s in shards]
    assemble_s = time.perf_counter() - t0
    total_s = time.perf_counter() - t_start
    pending_names = {t.paths.name for t in pending}
    done_stats = [s for t, s in zip(tasks, stats) if t.paths.name in pending_names]
    source_s = sum(s["source_s"] for s in done_stats)
    summary = BuildSummary(
        schema_version=SCHEMA_VERSION,
        samples=samples.num_rows,
        videos=len(set(samples.column("video_id").to_pylist())),
        annotations_matched=len(anns),
        shards=len(tasks),
        samples_per_shard=samples_per_shard,
        shards_built=len(pending),
        shards_skipped=len(tasks) - len(pending),
        frames=sum(samples.column("num_frames").to_pylist()),
        visual_tokens=sum(samples.column("visual_tokens").to_pylist()),
        input_tokens=sum(samples.column("input_tokens").to_pylist()),
        negatives=sum(1 for a in samples.column("answer").to_pylist() if a == "[]"),
        negatives_dropped=sum(j.negatives_dropped for j in jobs),
        rejects=rejects.num_rows,
        rejects_by_reason=dict(sorted(Counter(rejects.column("reason").to_pylist()).items())),
        timings_s=Timings(setup=round(setup_s, 3), probe=round(probe_s, 3), plan=round(plan_s, 3),
                          shards=round(shards_s, 3), assemble=round(assemble_s, 3), total=round(total_s, 3)),
        throughput=Throughput(videos_per_s=_rate(sum(s["videos"] for s in done_stats), shards_s),
                              windows_per_s=_rate(sum(s["samples"] for s in done_stats), shards_s),
                              realtime_factor=_rate(source_s, shards_s)),
    )
    versions = package_versions()
    record = BuildRecord(
        summary=summary,
        model_family=config.model_family,
        prompt=PromptInfo(layout=config.prompt_layout, transformers=versions.get("transformers")),
        tokenizer=tok_info,
        decode=_decode_info(config, set(samples.column("source_codec").to_pylist())),
        answer_format=ANSWER_FORMAT,
        versions=versions,
        shard_files=[ShardFile(name=s["shard"], sha256=s["sha256"], bytes=s["bytes"], samples=s["samples"],
                               sidecars={k: FileEntry(**v) for k, v in s["sidecars"].items()}) for s in stats],
        config=config.to_json(),
        budget=dataclasses.asdict(budget),
        max_input_tokens=bound,
    )
    with io_stage("build.json", out / BUILD_JSON):
        record.write(out, tmp=tmp_name(out / BUILD_JSON))
    return dataclasses.asdict(summary)


def _decode_info(config: BuildConfig, codecs: set[str]) -> DecodeInfo:
    """codecs: those of the build's samples, each recorded with the backend that decoded it."""
    return DecodeInfo(backend=config.decoder, resize=RESIZE, jpeg_quality=config.jpeg_quality,
                      backends={c: backend_for(config.decoder, c) for c in sorted(codecs)})


def _part_summary(config: BuildConfig, tasks: list[ShardTask], mine: list[ShardTask], pending: list[ShardTask],
                  probe_s: float, shards_s: float, total_s: float) -> dict:
    """What a --part build did (it writes no manifest: --assemble does, once every part is done)."""
    stats = [read_stats(t.paths) for t in mine]
    built = {t.paths.name for t in pending}
    source_s = sum(s["source_s"] for s in stats if s["shard"].removesuffix(".tar") in built)
    return {"part": config.part, "shards_total": len(tasks), "shards": len(mine), "shards_built": len(pending),
            "shards_skipped": len(mine) - len(pending), "samples": sum(s["samples"] for s in stats),
            "rejects": sum(s["rejects"] for s in stats),
            "timings_s": {"probe": round(probe_s, 3), "shards": round(shards_s, 3), "total": round(total_s, 3)},
            "realtime_factor": _rate(source_s, shards_s)}


def _rate(x: float, seconds: float) -> float | None:
    return round(x / seconds, 3) if seconds > 0 else None


def _check_plan(out: Path, config: BuildConfig, groups: list[list[str]]) -> None:
    """A resumed build must be the same build: same content-deciding config, same video -> shard plan."""
    plan = {"config_fingerprint": config.fingerprint(), "shards": {shard_name(i): g for i, g in enumerate(groups)},
            "decoder": config.decoder}  # named in the error below (`--decoder auto` may pick another on another machine)
    path = out / PLAN_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        if [old.get(k) for k in ("config_fingerprint", "shards")] != [plan["config_fingerprint"], plan["shards"]]:
            what = "config" if old.get("config_fingerprint") != plan["config_fingerprint"] else "inputs (videos/annotations)"
            if old.get("decoder", config.decoder) != config.decoder:
                what += (f": it was decoded with {old['decoder']}, this run decodes with {config.decoder} (pass "
                         f"--decoder {old['decoder']})")
            redo = ("empty it and run every part again" if config.part or config.assemble  # neither may --overwrite
                    else "rerun with --overwrite to rebuild it")
            raise BuildError(f"{out} holds a build with different {what}; {redo}, or choose another --out")
        return
    leftovers = [p.name for p in our_files(out) if p.name.startswith("shard-")]
    if leftovers:
        raise BuildError(f"{out} holds shard files but no {PLAN_FILE} ({leftovers[0]}, ...); use --overwrite")
    tmp = tmp_name(path)
    tmp.write_text(json.dumps(plan, indent=1))
    tmp.replace(path)


def _stall_s(config: BuildConfig) -> float | None:
    return config.decode_timeout or None  # 0: no watchdog


def _probe_all(paths: list[str], config: BuildConfig, pool: Pool) -> list[ProbeResult | ProbeFailure]:
    """Probe every file in the workers; a probe that hangs becomes a decode_timeout failure of that file."""

    def on_stall(path: str, label: str, waited: float) -> ProbeFailure:
        print(f"prep build: probing {path} made no progress for {waited:.1f} s (--decode-timeout "
              f"{config.decode_timeout:g}); its worker was killed and replaced, the video is rejected", file=sys.stderr)
        return ProbeFailure(path=path, reason="decode_timeout", stage="probe",
                            detail=f"{Path(path).name}: probing made no progress for --decode-timeout "
                                   f"{config.decode_timeout:g} s (its worker was killed and replaced)")

    out: list = [None] * len(paths)
    # probes run here, also under --ray, in one single-threaded process per core (at least --workers): a
    # probe decodes a frame or two and reads the last GOP's packets, and one process per worker left 15 of 16
    # cores idle at --workers 1 (the shard stage then gives each worker cores // workers threads)
    processes = max(_cores(), config.workers or 0)
    with closing(distribute(probe_one, paths, processes=processes, stall_s=_stall_s(config),
                            on_stall=on_stall, pool=pool)) as results:
        for i, result in results:
            out[i] = result
    return out


def _run_shards(tasks: list[ShardTask], config: BuildConfig, pool: Pool, streams: int) -> dict[str, ShardOutput]:
    """Process shards in the workers with a progress bar fed per video; returns each shard's output (name ->
    ShardOutput), read here as its worker reports it (none for a --part build). A file whose decode stalls is
    dropped from its shard (decode_timeout rejects) and the shard is rebuilt without it."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the watchdog forks replacement workers from this process
    total_videos = sum(len(t.videos) for t in tasks)
    bar = tqdm(total=total_videos, unit="video", disable=(not config.progress) or None, desc="prep build",
               dynamic_ncols=True)
    update = BuildProgress(bar)

    on_stall = ShardStall(decode_timeout=config.decode_timeout)
    built = {}
    pool.keep(config.workers if config.ray is None else 0)  # the probe's extra processes exit while shards start
    try:
        if config.ray is None:
            results = distribute(process_shard, tasks, processes=config.workers, streams=streams,
                                 stall_s=_stall_s(config), on_stall=on_stall, on_progress=update, pool=pool)
        else:  # a Ray task per shard; each runs the shard under the same watchdog on its node
            from prep import ray_distributor

            results = ray_distributor.distribute(process_shard, tasks, address=config.ray or None,
                                                 in_flight=config.workers, stall_s=_stall_s(config), on_stall=on_stall,
                                                 warm=warm_shard_worker)
        with closing(results):
            for i, stats in results:
                if config.ray is not None:  # no per-video beats cross the cluster: the bar moves per shard
                    update(((tasks[i].paths.name,), stats["videos"], stats.get("windows", 0), stats.get("source_s", 0.0)))
                if config.part is None:  # a --part build assembles nothing: --assemble reads every shard
                    with io_stage("assemble", tasks[i].paths.samples):
                        built[tasks[i].paths.name] = read_shard(tasks[i].paths, stats)
    finally:
        bar.close()
    return built


class BuildProgress:
    """The bar's on_progress: (unit, videos, windows, source s) per finished work unit, each unit counted once.
    A shard rerun after a stall or a dead worker redoes units that had already reported; counting them again
    ran the bar past its total and overstated the rate."""

    def __init__(self, bar):
        self.bar, self.start, self.seen = bar, time.perf_counter(), set()
        self.windows, self.source_s = 0, 0.0

    def __call__(self, item) -> None:
        unit, videos, windows, source_s = item
        if unit in self.seen:
            return
        self.seen.add(unit)
        self.windows += windows
        self.source_s += source_s
        dt = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.windows / dt:.1f} windows/s, {self.source_s / dt:.1f}x realtime", refresh=False)
        self.bar.update(videos)


@dataclasses.dataclass(frozen=True)
class ShardStall:
    """on_stall for shard tasks (a picklable object: a Ray task carries it to its node). A stalled decode
    drops that file from the shard (decode_timeout rejects) and the shard is rebuilt without it."""

    decode_timeout: float

    def __call__(self, task: ShardTask, label: str, waited: float) -> Retry:
        if label not in {v.probe.path for v in task.videos} or label in task.timed_out:
            raise BuildError(f"{task.paths.name}: its worker made no progress for {waited:.0f} s on {label} "
                             f"(--decode-timeout {self.decode_timeout:g})")
        print(f"prep build: decoding {label} made no progress for {waited:.1f} s (--decode-timeout "
              f"{self.decode_timeout:g}); its worker was killed and replaced, {task.paths.name} is rebuilt "
              f"without it (decode_timeout rejects)", file=sys.stderr)
        return Retry(dataclasses.replace(task, timed_out=task.timed_out + (label,)))


# ----------------------------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m prep build",
        description="Decode videos once into token-budgeted WebDataset shards + manifest.parquet, rejects.parquet "
                    "and build.json. Bad inputs become rows in rejects.parquet; a rerun resumes.",
        epilog=f"exit codes: 0 done; {EXIT_NO_SAMPLE} no sample written (every input rejected); {EXIT_CONFIG} invalid "
               f"flags or --out holds a different build; {EXIT_LOCKED} another build holds --out (its pid, host and "
               f"start time are named); {EXIT_IO} an OS error such as no space left (stage and path named; rerun the "
               f"same command to resume)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = ap.add_argument
    a("--videos", required=True, type=Path, help="directory searched recursively for mp4/mkv/webm/mov/avi/mpg files")
    a("--out", required=True, type=Path, help="output directory for shards, manifest.parquet, rejects.parquet, build.json")
    a("--annotations", type=Path, default=None,
      help="annotations: jsonl, .parquet, or a datasets.save_to_disk directory (default: VIDEOS/annotations.jsonl)")
    a("--format", choices=FORMATS, default="default",
      help="annotation fields: default = video, segments [[s, e], ...], id, query; "
           "qvhighlights = vid, relevant_windows, query, qid (video file VIDEOS/<vid>.<ext>)")
    a("--window-seconds", type=float, default=16.0, help="window length in source seconds")
    a("--stride-seconds", type=float, default=None, help="distance between window starts (default: window length)")
    a("--last-window", choices=LAST_WINDOW, default="keep",
      help="last partial window: keep it if >= --min-window-seconds, drop it, or extend it back to full length")
    a("--min-window-seconds", type=float, default=MIN_LAST_S, help="shortest partial window kept by --last-window keep")
    a("--min-segment-seconds", type=float, default=answers_mod.MIN_SEGMENT_S,
      help="drop answer pieces shorter than this after clipping to the window")
    a("--negatives", choices=("keep", "drop"), default="keep", help="windows without any segment: keep them with answer [] or drop them")
    a("--fps", type=float, default=2.0, help="frames sampled per source second inside a window (qwen-vl-utils smart_nframes rules)")
    a("--max-frames", type=int, default=FPS_MAX_FRAMES,
      help=f"frames per window at most (default {FPS_MAX_FRAMES}, qwen-vl-utils' FPS_MAX_FRAMES); a longer window "
      "is sampled more sparsely, as qwen-vl-utils does")
    a("--model-family", choices=sorted(PATCH_SIZE), default="qwen3_vl", help="patch geometry: qwen3_vl/qwen3_5 patch 16, qwen2_5_vl patch 14")
    a("--video-min-tokens", type=int, default=None, help="per-frame minimum tokens (default: $VIDEO_MIN_TOKEN_NUM or 128)")
    a("--video-max-tokens", type=int, default=None, help="per-frame maximum tokens (default: $VIDEO_MAX_TOKEN_NUM or 768)")
    a("--max-input-tokens", type=int, default=None,
      help="cap on a whole sample's tokens (text included): lowers the frame count; a window that does not fit "
           "with 2 frames is rejected (over_token_budget). The answer is never cut. Default: the model's own "
           "maximum (the tokenizer's model_max_length, or config.json's max_position_embeddings if smaller)")
    a("--tokenizer", type=Path, default=None, help="tokenizer or model directory (default: the small tokenizer shipped with the package)")
    a("--allow-outside-videos", action="store_true",
      help="read annotation paths that resolve (symlinks followed) outside --videos, e.g. ../x.mp4 or /abs/x.mp4; "
           "by default each is rejected (path_outside_videos)")
    a("--prompt-layout", choices=sorted(LAYOUTS), default=DEFAULT_LAYOUT,
      help="how the video item expands: nested = what transformers 5.0-5.24's Qwen3VLProcessor produces (the chat "
           "template's <|vision_start|>..<|vision_end|> kept around the per-group blocks); flat = transformers "
           ">= 5.25 and 4.57, vLLM before PR 46957 (wrapper replaced). Default: the installed transformers' "
           f"({DEFAULT_LAYOUT}). Pick the one your serving stack produces")
    a("--query", default=DEFAULT_QUERY, help="instruction for annotations without their own query")
    a("--query-template", default=None,
      help="how an annotation's own query becomes the instruction, with {query} (default: '{query}'; "
           "qvhighlights: a moment-retrieval instruction)")
    a("--jpeg-quality", type=int, default=95, help="JPEG quality of the stored frames")
    a("--decoder", choices=(AUTO, *BACKENDS), default=DEFAULT_BACKEND,
      help=f"video decoder (prep/decoders.py): {AUTO} (default) takes the first of {', '.join(AUTO_ORDER)} that loads "
           "here, qwen-vl-utils' own order; torchcodec needs the system FFmpeg libraries and costs 1.4-3.8 s of "
           "imports, so on a few minutes of video decord finishes first. Same frame indices and timestamps, pixels "
           "within 1 level (README); the probe uses decord. "
           f"decord decodes only {', '.join(DECORD_EXACT_CODECS)}: it returns neighbouring frames on HEVC and "
           f"MPEG-4 with B-frames, so other codecs are decoded by {EXACT_FALLBACK} (build.json decode.backends)")
    a("--samples-per-shard", type=int, default=None,
      help="most samples per shard (whole videos, a longer one cut into pieces; a shard may hold fewer). Shards are "
           "the units of work, so the default is 256 only for builds of 32,768 windows or more and fewer below "
           "(windows / 128, at least 4: ~128 shards to spread over the cores); build.json records what was used")
    a("--shard-size-mb", type=float, default=1024.0, help="soft cap on estimated shard size in MiB (0: none)")
    a("--workers", type=int, default=None,
      help="processes that build shards (default: all cores); each keeps cores // workers cores busy by building "
           "up to 3/4 of that many shards at once, one decoder thread each (fewer shards: more decoder threads "
           "each), with a quarter of the cores for resize + JPEG (prep.build.worker_threads); probing runs in "
           "max(cores, workers) single-threaded processes, the same ones")
    a("--decode-timeout", type=float, default=DECODE_TIMEOUT_S,
      help="seconds a video's probe or decode may go without finishing a window; past it the video is rejected "
           "(decode_timeout), its worker process is killed and replaced, and the build goes on (0: no watchdog)")
    a("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
      help="run each shard as a Ray task on a cluster (pip install ray; video-ora installed on every node; --videos "
           "and --out on a filesystem every node sees, at the same path). ADDRESS as ray.init takes it (auto, "
           "HOST:PORT); without it Ray's default (RAY_ADDRESS, a cluster started on this machine, else a new "
           "local one). --workers then caps the shard tasks in flight (default: no cap)")
    a("--part", default=None, metavar="K/N",
      help="build only part K of N of the shards (every N-th shard from the K-th), e.g. one Slurm array task each; "
           "no manifest is written: run the same command with --assemble once every part is done")
    a("--assemble", action="store_true",
      help="build no shard: check that every shard is complete (the parts are done), then write manifest.parquet, "
           "rejects.parquet and build.json")
    a("--overwrite", action="store_true", help="delete this build's files in --out and rebuild (default: resume)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return ap


def config_from_args(args: argparse.Namespace) -> BuildConfig:
    values = vars(args).copy()
    if values.get("shard_size_mb") == 0:
        values["shard_size_mb"] = None
    return BuildConfig(**values)


def summary_lines(summary: dict, out: Path, decoded_with: str) -> list[str]:
    th = summary["throughput"]
    lines = [
        f"prep build: {summary['samples']} samples from {summary['videos']} videos in {summary['shards']} shards "
        f"({summary['shards_built']} built, {summary['shards_skipped']} already complete) in {summary['timings_s']['total']:.1f} s",
        f"  {summary['negatives']} negatives kept, {summary['negatives_dropped']} dropped (--negatives drop); "
        f"{summary['frames']} frames, {summary['input_tokens']} input tokens ({summary['visual_tokens']} visual); "
        f"{th['videos_per_s']} videos/s, {th['windows_per_s']} windows/s, {th['realtime_factor']}x realtime",
        f"  rejects: {summary['rejects']}" + ("" if not summary["rejects"] else
                                            " (" + ", ".join(f"{k} {v}" for k, v in summary["rejects_by_reason"].items()) + ")"),
        f"  decoded with {decoded_with}; wrote {out / 'manifest.parquet'}, {out / 'rejects.parquet'}, {out / 'build.json'}",
    ]
    return lines


def cli(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = config_from_args(args)
    try:
        summary = build(config)
    except BuildError as e:
        print(f"prep build: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except BuildLocked as e:
        print(f"prep build: error: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except BuildIOError as e:
        print(f"prep build: error: {e}", file=sys.stderr)
        return EXIT_IO
    except RuntimeError as e:
        if type(e).__name__ != "RayUnavailable":  # prep/ray_distributor.py (ray is imported there only)
            raise
        print(f"prep build: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if "part" in summary:
        print(f"prep build --part {summary['part']}: {summary['shards']} of the build's {summary['shards_total']} "
              f"shards ({summary['shards_built']} built, {summary['shards_skipped']} already complete), "
              f"{summary['samples']} samples, {summary['rejects']} rejects, in {summary['timings_s']['total']:.1f} s; "
              f"once every part is done, run the same command with --assemble instead of --part")
        print(json.dumps({"event": "prep_build_part_done", **summary}, sort_keys=True))
        return 0
    decoded_with = config.decoder + (f" (--decoder {args.decoder})" if args.decoder != config.decoder else "")
    print("\n".join(summary_lines(summary, config.out, decoded_with)))
    print(json.dumps({"event": "prep_build_done", **summary}, sort_keys=True))
    if summary["samples"] == 0:
        print(f"prep build: error: no sample was written; all inputs were rejected, see {config.out / 'rejects.parquet'}",
              file=sys.stderr)
        return EXIT_NO_SAMPLE
    return 0


if __name__ == "__main__":
    sys.exit(cli())
