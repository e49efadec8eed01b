"""Stage 7: the shard as the unit of work (img2dataset style).

A shard is a group of whole videos (a video with more windows than a shard holds is cut into pieces of
consecutive windows first, prep.build.split_long_videos). Its files, in the order they are written:
    shard-000000.tar.<pid>-<rand>.tmp  WebDataset tar being written (schemas/shard.py layout), a name
                                       only this writer uses (prep/outdir.py)
    shard-000000.samples.parquet       one SampleRecord per sample in the tar
    shard-000000.rejects.parquet       one RejectRecord per window/video of the group that produced no sample
    shard-000000.tar                   the writer's own temp renamed once complete
    shard-000000.stats.json            written LAST, with the size and sha256 of the tar and both sidecars
A shard is complete when its stats file, tar and sidecars exist and the sizes match the stats file. A rerun
skips complete shards and rebuilds every other one from scratch (one missing sidecar included: nothing is
dropped); manifest.parquet and rejects.parquet are assembled from the sidecars afterwards.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from prep import faults
from prep.outdir import INPUT_REJECTS, tmp_name
from schemas.manifest import RejectRecord, SampleRecord, arrow_schema
from schemas.shard import JSON_EXT, ShardSample, frame_ext



def shard_name(index: int) -> str:
    return f"shard-{index:06d}"


@dataclasses.dataclass(frozen=True)
class ShardPaths:
    out: Path
    name: str  # shard-000000

    @property
    def tar(self) -> Path:
        return self.out / f"{self.name}.tar"

    @property
    def samples(self) -> Path:
        return self.out / f"{self.name}.samples.parquet"

    @property
    def rejects(self) -> Path:
        return self.out / f"{self.name}.rejects.parquet"

    @property
    def stats(self) -> Path:
        return self.out / f"{self.name}.stats.json"

    def sidecars(self) -> dict[str, Path]:
        return {"samples": self.samples, "rejects": self.rejects}

    def incomplete(self) -> str | None:
        """Why this shard must be (re)built, None when it is complete: its stats file, tar and both sidecars
        exist and have the sizes the stats file recorded (sha256 is verify's job: sizes cost no read)."""
        if not self.stats.is_file():
            return "not built"
        try:
            stats = read_stats(self)
            expected = [(self.tar, stats["bytes"])]
            expected += [(path, stats["sidecars"][kind]["bytes"]) for kind, path in self.sidecars().items()]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{self.stats.name} is unreadable or from an older build ({type(e).__name__}: {e})"
        for path, size in expected:
            if not path.is_file():
                return f"{path.name} is missing"
            if path.stat().st_size != size:
                return f"{path.name} has {path.stat().st_size} bytes, {self.stats.name} recorded {size}"
        return None

    def clear(self) -> None:
        """Remove the final files an interrupted attempt left (stats first, so a crash here stays incomplete).
        Temporary files are never touched here: each belongs to its writer (stale ones: outdir.sweep_temps)."""
        for p in (self.stats, self.tar, self.samples, self.rejects):
            p.unlink(missing_ok=True)


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    """A tar member with fixed metadata, so rebuilding the same inputs gives a byte-identical shard."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    return info, io.BytesIO(data)


class ShardWriter:
    """Writes one shard's tar under a temporary name of its own; commit() renames that file (and only that
    file) to the shard's tar and returns (sha256, bytes)."""

    def __init__(self, paths: ShardPaths):
        self.paths = paths
        self.tmp = tmp_name(paths.tar)
        self._file = open(self.tmp, "xb")  # exclusive: a name collision fails instead of sharing a file
        self._hash = hashlib.sha256()
        # copybufsize: a frame (~140 KB at 640x352) goes out in one write, not tarfile's 16 KiB pieces (each a
        # hash update, a tell and a write call: ~21,000 a build of 32 shards, ~6,000 now)
        self._tar = tarfile.open(fileobj=_HashingWriter(self._file, self._hash, self.tmp), mode="w",
                                 format=tarfile.USTAR_FORMAT, copybufsize=1 << 20)
        self.samples = 0

    def add(self, sample: ShardSample, jpegs: list[bytes]) -> None:
        key = sample.record.key
        if len(jpegs) != sample.record.num_frames:
            raise ValueError(f"{key}: {len(jpegs)} frames for num_frames={sample.record.num_frames}")
        self._tar.addfile(*_member(f"{key}.{JSON_EXT}", json.dumps(sample.to_json(), separators=(",", ":")).encode()))
        for i, data in enumerate(jpegs):
            self._tar.addfile(*_member(f"{key}.{frame_ext(i)}", data))
        self.samples += 1

    def commit(self) -> tuple[str, int]:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        os.replace(self.tmp, self.paths.tar)
        return self._hash.hexdigest(), size

    def abort(self) -> None:
        """Remove the partial tar; never raises over the error that caused the abort."""
        try:
            self._file.close()  # closes the descriptor even when flushing the buffer fails
        except OSError:  # e.g. no space for the buffered bytes: they are being thrown away anyway
            pass
        self.tmp.unlink(missing_ok=True)


class _HashingWriter:
    """File wrapper that hashes what tarfile writes, so the sha256 costs no second read, and starts the disk
    writing every WRITEBACK_BYTES (sync_file_range, Linux), so commit()'s fsync waits for the last few MiB
    instead of the whole tar: 2-core box, 32 shards of 8.4 MB, the commits' wall 0.23 -> 0.03 s a build
    (BENCHMARKS.md, Prep, session 19)."""

    def __init__(self, f, h, path: Path):
        self._f, self._h, self._path = f, h, path
        self._started = 0  # bytes whose writeback has been started

    def write(self, data: bytes) -> int:
        faults.maybe_enospc(self._path)
        self._h.update(data)
        n = self._f.write(data)
        end = self._f.tell()
        if end - self._started >= WRITEBACK_BYTES and _start_writeback is not None:
            self._f.flush()
            _start_writeback(self._f.fileno(), self._started, end - self._started)
            self._started = end
        return n

    def tell(self) -> int:
        return self._f.tell()


def _writeback_function():
    """sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE): queue those bytes for the disk, don't wait
    (None where libc has no such call). A failure is left to the fsync that follows (it reports write errors)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None).sync_file_range  # this process's libc
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


WRITEBACK_BYTES = 4 << 20
_start_writeback = _writeback_function()


def write_stats(paths: ShardPaths, stats: dict) -> None:
    tmp = tmp_name(paths.stats)
    tmp.write_text(json.dumps(stats, indent=1, sort_keys=True))
    tmp.replace(paths.stats)


def read_stats(paths: ShardPaths) -> dict:
    return json.loads(paths.stats.read_text())


SHARD_SAMPLES = 256  # the most samples a shard holds by default (~0.5 GB of 640x352 q95 frames at 32 a sample)
SHARDS_AT_LEAST = 128  # what the default aims for: shards are the build's units of work (see shard_samples)
SHARD_SAMPLES_AT_LEAST = 4  # ... but no fewer samples than this in a shard by default (see shard_samples)


def shard_samples(windows: int, asked: int | None) -> int:
    """Samples per shard: --samples-per-shard when given; by default SHARD_SAMPLES, or fewer for a build of fewer
    than SHARDS_AT_LEAST x SHARD_SAMPLES windows, so that it still has ~SHARDS_AT_LEAST shards to spread over the
    cores: with 256 a 32-clip build (64 windows) was one shard on one worker, 12.7 s against 8.3 s as 32 shards on
    2 cores (BENCHMARKS.md, Prep, session 17). At least SHARD_SAMPLES_AT_LEAST: a long video is cut into pieces
    of at most this many windows (prep.build.split_long_videos), each piece decoding from the keyframe before it,
    an extra GOP that would outweigh a 1-window piece. The windows of the build decide it, never this machine's
    cores, so a rerun, a --part and a Ray build plan the same shards."""
    if asked is not None:
        return asked
    return max(SHARD_SAMPLES_AT_LEAST, min(SHARD_SAMPLES, -(-windows // SHARDS_AT_LEAST)))


def group_videos(weights: list[tuple[str, int, int]], samples_per_shard: int, shard_bytes: int | None) -> list[list[str]]:
    """Greedy, deterministic grouping of whole videos into shards.

    weights: (unit, planned windows, estimated bytes) in the order to keep; a unit is a video file with
    all its annotations (the build sorts them by annotation id), or a piece of a long video
    (prep.build.split_long_videos). A unit never splits here; a shard closes when the next video would push it past samples_per_shard or
    shard_bytes (a soft cap: a single large video still gets its own shard).
    """
    groups: list[list[str]] = []
    current: list[str] = []
    n = size = 0
    for vid, windows, nbytes in weights:
        over = n + windows > samples_per_shard or (shard_bytes is not None and size + nbytes > shard_bytes)
        if current and over:
            groups.append(current)
            current, n, size = [], 0, 0
        current.append(vid)
        n += windows
        size += nbytes
    if current:
        groups.append(current)
    return groups


@dataclasses.dataclass(frozen=True)
class ShardOutput:
    """What manifest.parquet, rejects.parquet and build.json take from one complete shard."""
    stats: dict
    samples: pa.Table
    rejects: pa.Table


def read_shard(paths: ShardPaths, stats: dict | None = None) -> ShardOutput:
    """A complete shard's stats (read unless given: a worker returns what it wrote) and sidecar tables. The build
    reads each shard as its worker reports it, while the others are still being built, so assembling the manifest
    at the end reads nothing but the shards an earlier run built (0.12 s of 1.92 on the 16-core host's bench,
    BENCHMARKS.md, Prep, session 18). Every sidecar must be there (the shard is complete): a missing one is an
    error, never a table without its rows."""
    return ShardOutput(stats=read_stats(paths) if stats is None else stats,
                       samples=pq.read_table(paths.samples).cast(arrow_schema(SampleRecord)),
                       rejects=pq.read_table(paths.rejects).cast(arrow_schema(RejectRecord)))


def assemble(out: Path, shards: list[ShardOutput]) -> tuple[pa.Table, pa.Table]:
    """manifest.parquet (sorted by sample_id) and rejects.parquet (sorted: the input rejects and the shards')."""
    samples = (pa.concat_tables([s.samples for s in shards]) if shards
               else arrow_schema(SampleRecord).empty_table()).sort_by("sample_id")
    input_rejects = pq.read_table(out / INPUT_REJECTS).cast(arrow_schema(RejectRecord))
    rejects = pa.concat_tables([input_rejects] + [s.rejects for s in shards])
    rejects = rejects.sort_by([(c, "ascending") for c in ("video_id", "source_path", "stage", "reason", "detail")])
    for name, table in (("manifest.parquet", samples), ("rejects.parquet", rejects)):
        tmp = tmp_name(out / name)
        pq.write_table(table, tmp)
        tmp.replace(out / name)
    return samples, rejects


def file_entry(path: Path) -> dict:
    """What the stats file and build.json record of one file of a shard."""
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
