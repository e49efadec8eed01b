"""Fault injection for the reliability tests of `prep build` (the training side has train/faults.py).

VIDEO_ORA_PREP_FAULT=kind:name[,kind:name...], read once per process; nothing happens without it:
    decode_hang:FILE  the decoder of the video whose file name is FILE blocks forever after its first window,
                      as decord's get_batch hang does (the watchdog must reject it: decode_timeout)
    probe_hang:FILE   the probe of that file blocks forever
    enospc:FILE       a write to a file whose name starts with FILE fails with ENOSPC (for machines where a
                      test cannot mount a small filesystem and fill it for real)
    kill_worker:FILE  the process running the shard task that decodes FILE is killed with SIGKILL after the first
                      window (mid-shard, its tar half written): under Ray the Ray worker process (its decode child
                      dies with it), locally the pool's worker process. With VIDEO_ORA_PREP_FAULT_ONCE=DIR it
                      happens once per FILE (a marker file in DIR, shared by every process of one machine), so
                      the retry of the task succeeds
A cluster distributor forwards both variables to its tasks (prep/ray_distributor.py).
"""
from __future__ import annotations

import errno
import os
import signal
import time
from functools import lru_cache

FAULT_ENV = "VIDEO_ORA_PREP_FAULT"
FAULT_ONCE_ENV = "VIDEO_ORA_PREP_FAULT_ONCE"
# pid of the process that owns the current shard task (set by a distributor that runs the task in a child
# process, e.g. the Ray task around its watchdog child); None: this process
TASK_PROCESS: int | None = None


@lru_cache(maxsize=1)
def _faults(spec: str) -> frozenset[tuple[str, str]]:
    return frozenset(tuple(item.split(":", 1)) for item in spec.split(",") if ":" in item)


def _active(kind: str) -> list[str]:
    spec = os.environ.get(FAULT_ENV, "")
    return [name for k, name in _faults(spec) if k == kind] if spec else []


def maybe_hang(point: str, path: str) -> None:
    """Block forever when `point`_hang (decode_hang, probe_hang) names this video file."""
    if os.path.basename(path) in _active(f"{point}_hang"):
        while True:
            time.sleep(3600)


def maybe_enospc(path: str) -> None:
    """Raise the OSError a full disk raises when enospc names this file."""
    if any(os.path.basename(path).startswith(name) for name in _active("enospc")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def maybe_kill(point: str, path: str) -> None:
    """SIGKILL the process that owns the shard task when kill_worker names this video file (once per file
    when FAULT_ONCE_ENV names a directory)."""
    name = os.path.basename(path)
    if point != "decode" or name not in _active("kill_worker"):
        return
    once = os.environ.get(FAULT_ONCE_ENV)
    if once:
        try:
            os.close(os.open(os.path.join(once, f"kill_worker-{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # already killed once
    os.kill(TASK_PROCESS or os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the owner is gone; this child dies with it (PR_SET_PDEATHSIG)
