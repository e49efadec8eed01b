"""The output directory of one build: who holds it (the build lock), temporary names, which files are ours.

Lock: `OUT/build.lock`, held with fcntl.flock from the first write to the last, its holder (pid, host,
start time, command line) written inside. A second build on the same folder stops at once naming the
holder. The kernel drops a flock when the last descriptor of it closes, so a build killed by any signal
(kill -9 included) leaves the file but not the lock: the next build takes it over and says whose it was.
Forked workers share the parent's descriptor, so a worker still alive keeps the folder locked. flock is
reliable between processes of one host; on NFS Linux turns it into a POSIX byte-range lock, which NFSv4
servers honour across hosts (older ones may not: use one --out per host there).
Parts (`prep build --part K/N`, one per machine of e.g. a Slurm array) hold `build.lock` SHARED, so parts
run together while a whole build or `--assemble` (exclusive) waits for none of them, and each part holds
its own `build.part-K-of-N.lock` exclusively (two copies of one part refuse each other).

Temporary files: every writer writes under its own name, `<final name>.<pid>-<random>.tmp`, and renames
only that file into place, so two writers can never publish or delete each other's partial bytes. Temps
left by a dead build are removed by the next build once it holds the lock (no other build can be live).
--overwrite renames the old build's files into `OUT/.overwritten.<pid>-<random>.tmp/` and deletes that folder
while the new build runs (Discard); the next build does the same with such a folder a killed build left.

OS errors (no space, permission denied, read-only filesystem, ...) become a BuildIOError naming the stage
and the path (`with io_stage("write shard", path): ...`), printed as one line with exit code 4: nothing is
published half-written (temps are renamed only when complete), so rerunning the same command once the
cause is gone resumes the build.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = "build.lock"
TMP_SUFFIX = ".tmp"
PLAN_FILE = "build.plan.json"  # the video -> shard plan a resumed build must match
INPUT_REJECTS = "input.rejects.parquet"  # rejects found before any shard (annotations, probe)
DISCARD = ".overwritten"  # + .<pid>-<random>.tmp: the folder of --overwrite's old files, being deleted
# files of a build besides shard-*: what --overwrite deletes and whose temps the lock holder may sweep
BUILD_FILES = ("manifest.parquet", "rejects.parquet", "build.json", PLAN_FILE, INPUT_REJECTS)


class BuildLocked(RuntimeError):
    """Another live build holds --out."""


class BuildIOError(RuntimeError):
    """An OS error at a named stage of the build, on a named path (picklable: it crosses from workers)."""

    def __init__(self, stage: str, path: str, errno_: int | None, strerror: str):
        super().__init__(stage, path, errno_, strerror)
        self.stage, self.path, self.errno, self.strerror = stage, path, errno_, strerror

    def __str__(self) -> str:
        code = f" ({errno.errorcode[self.errno]})" if self.errno in errno.errorcode else ""
        return (f"{self.strerror}{code} at stage '{self.stage}' on {self.path}; fix that (free space, permissions, "
                f"a writable mount) and rerun the same command: the build resumes")


@contextmanager
def io_stage(stage: str, path: str | Path) -> Iterator[None]:
    """Turn an OSError raised inside into a BuildIOError for `stage`, naming the error's own file when it
    has one (open, rename), else `path` (a write to an open file, pyarrow)."""
    try:
        yield
    except OSError as e:
        code = e.errno
        if code is None:  # pyarrow's IO errors carry the errno in their text only
            found = re.search(r"errno (\d+)", str(e), re.IGNORECASE)
            code = int(found.group(1)) if found else None
        text = e.strerror or (os.strerror(code) if code else str(e).strip().splitlines()[0])
        raise BuildIOError(stage, str(e.filename or path), code, text) from e


def tmp_name(final: Path) -> Path:
    """A temporary path next to `final` that no other writer (process or call) uses."""
    return final.with_name(f"{final.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")


def is_ours(name: str) -> bool:
    """A file name (final or temporary) that belongs to a build in this folder."""
    if name.startswith("shard-"):
        return True
    return any(name == f or (name.startswith(f + ".") and name.endswith(TMP_SUFFIX)) for f in BUILD_FILES)


def our_files(out: Path) -> list[Path]:
    """Every file a build wrote in `out` (never the lock file)."""
    return sorted(p for p in out.iterdir() if p.is_file() and p.name != LOCK_FILE and is_ours(p.name))


def part_lock_name(k: int, n: int) -> str:
    return f"build.part-{k}-of-{n}.lock"


def sweep_temps(out: Path, prefixes: tuple[str, ...] | None = None) -> list[str]:
    """Remove temporary files of earlier builds (only those whose name starts with one of `prefixes`, e.g.
    a part's own shards, when given); call only while holding the lock that covers them."""
    gone = []
    for p in our_files(out):
        if p.name.endswith(TMP_SUFFIX) and (prefixes is None or p.name.startswith(prefixes)):
            p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def discard_folders(out: Path) -> list[Path]:
    """The folders of --overwrite builds that were killed before they had deleted the old build (Discard)."""
    return sorted(p for p in out.glob(f"{DISCARD}.*{TMP_SUFFIX}") if p.is_dir())


class Discard:
    """--overwrite's deletion of the old build, off the build's path: its files (and the folders of killed earlier
    discards) are renamed into a folder of their own (a rename each, instant) and a thread deletes that folder
    while the new build probes and decodes.
    Unlinking a build's files costs the kernel time per cached page: 0.08 of a 7.5 s build on the 2-core box (the
    16-core host's setup stage, 0.105 of 1.92 s, is most likely the same; BENCHMARKS.md, Prep, session 19).
    Leaving the `with` block waits for the thread, and raises what it met as a BuildIOError of stage clean (the
    folder then stays, and the next build deletes it: discard_folders)."""

    def __init__(self, out: Path, files: list[Path]):
        self.folder = tmp_name(out / DISCARD)
        self.folder.mkdir()
        for p in files:
            p.rename(self.folder / p.name)
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._remove, name="discard", daemon=True)
        self._thread.start()

    def _remove(self) -> None:
        try:
            shutil.rmtree(self.folder)
        except OSError as e:
            self._error = e

    def __enter__(self) -> "Discard":
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join()
        if self._error is not None and exc[0] is None:
            with io_stage("clean", self.folder):
                raise self._error


@dataclasses.dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds (or last held) a build lock."""

    pid: int
    host: str
    started: str  # UTC, ISO 8601
    argv: list[str]

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


class BuildLock:
    """`with BuildLock(out) as lock:` (or acquire()/release()) holds OUT/build.lock; lock.previous is the dead
    holder it replaced. shared=True: a part's hold (many at once, no holder written); name: another lock file
    in OUT (a part's own)."""

    def __init__(self, out: Path, *, name: str = LOCK_FILE, shared: bool = False):
        self.path = Path(out) / name
        self.shared = shared
        self.previous: Holder | None = None
        self._fd: int | None = None

    def __enter__(self) -> "BuildLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> "BuildLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = _read_holder(self.path, retries=20)
            who = str(holder) if holder else ("--part builds (they hold it shared) or a process that has not "
                                             "written its name yet")
            raise BuildLocked(f"{self.path.parent} is in use by another build ({who}; lock {self.path}); "
                              f"wait for it to finish, or choose another --out") from None
        if self.shared:  # many holders at once: none writes its name (the exclusive holder's stays readable)
            self._fd = fd
            return self
        # the lock is ours: whatever holder is written here died without releasing (flock went with it)
        self.previous = _read_holder(self.path)
        me = Holder(pid=os.getpid(), host=socket.gethostname(),
                    started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), argv=list(sys.argv))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dataclasses.asdict(me)).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None and self.shared:
            os.close(self._fd)
            self._fd = None
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)  # a clean end leaves no holder to "take over"; the file stays (no unlink race)
            except OSError:  # e.g. the filesystem went read-only: the stale holder line only makes the next build
                pass  # say "took over"; the error that matters is the one being raised, if any
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


def _read_holder(path: Path, retries: int = 0) -> Holder | None:
    """The holder written in a lock file; a holder that just took the lock may not have written yet."""
    for attempt in range(retries + 1):
        try:
            data = json.loads(path.read_bytes() or b"null")
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            try:
                return Holder(pid=int(data["pid"]), host=str(data["host"]), started=str(data["started"]),
                              argv=list(data.get("argv", [])))
            except (KeyError, TypeError, ValueError):
                return None
        if attempt < retries:
            time.sleep(0.05)
    return None
