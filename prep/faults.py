"""Fault injection for the reliability tests of `prep build` (the training side has train/faults.py).

VIDEO_ORA_PREP_FAULT=kind:name[,kind:name...], read once per process; nothing happens without it:
    decode_hang:FILE  the decoder of the video whose file name is FILE blocks forever after its first window,
                      as decord's get_batch hang does (the watchdog must reject it: decode_timeout)
    probe_hang:FILE   the probe of that file blocks forever
    enospc:FILE       a write to a file whose name starts with FILE fails with ENOSPC (for machines where a
                      test cannot mount a small filesystem and fill it for real)
"""
from __future__ import annotations

import errno
import os
import time
from functools import lru_cache

FAULT_ENV = "VIDEO_ORA_PREP_FAULT"


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
