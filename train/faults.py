"""Fault injection for the reliability tests and scripts/fault_matrix.py (the simulated OOM lives in
train.memory.maybe_fail).

VIDEO_ORA_KILL_AT=point:step[:rank] makes the process SIGKILL itself when it reaches `point` at global
`step` (every rank, or only `rank`): a kill -9 at an exact place instead of a timing guess. Points:
checkpoint_state (DeepSpeed's checkpoint files are written, the trainer state not yet), checkpoint_marker
(every rank's files on disk, checkpoint.json not yet), checkpoint_latest (checkpoint.json written,
`latest` not yet).

VIDEO_ORA_STALL_AT=point:step[:rank] makes the process sleep STALL_S seconds there instead: a slow rank at an
exact place. Point: error_report (a user error caught, not yet printed; step 0).
"""
from __future__ import annotations

import os
import signal
import time

KILL_ENV = "VIDEO_ORA_KILL_AT"
STALL_ENV = "VIDEO_ORA_STALL_AT"
STALL_S = 2.0


def armed(env: str, point: str, step: int, rank: int) -> str | None:
    """The spec in `env` ("point:step[:rank]") when it names this point, step and rank, else None: the one
    parser behind every training fault hook."""
    spec = os.environ.get(env)
    if not spec:
        return None
    parts = spec.split(":")
    if parts[0] != point or int(parts[1]) != step or (len(parts) > 2 and int(parts[2]) != rank):
        return None
    return spec


def maybe_kill(point: str, step: int, rank: int) -> None:
    if armed(KILL_ENV, point, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_stall(point: str, step: int, rank: int) -> None:
    if armed(STALL_ENV, point, step, rank):
        time.sleep(STALL_S)
