"""Worker processes for `prep build`: a distributor that is a plain function taking the worker, and a watchdog.

    for index, result in distribute(worker, tasks, processes=4, stall_s=300, on_stall=...): ...

Each worker process runs `worker(task)` for one task at a time and reports progress with `heartbeat(label)`
(the build beats once per decoded window, naming the video file). A worker whose last beat is older than
`stall_s` is stuck (decord 0.6's get_batch hang is the most reported decoder problem): it is killed with
SIGKILL and replaced by a fresh process, and `on_stall(task, label, waited_s)` decides what the task becomes:
`Retry(task)` runs a changed task (the build drops the stuck video from its shard), anything else is the
task's result. Results come back in completion order with their task index.

Processes are forked (the parent has not opened a decoder); each dies with the parent (PR_SET_PDEATHSIG),
ignores SIGINT (the parent stops everyone on Ctrl-C) and never outlives `distribute`, or, given `pool=Pool()`,
the pool: then the processes stay for the next distribute() call (the build probes and builds its shards with
the same processes) and the worker function travels with each task (it must be picklable: module-level).
Each process gets its first task as soon as it is forked, so the first ones work while the parent forks the
rest (a fork of a parent holding torch and transformers costs 15-25 ms, serially in the parent). An exception in a
worker is raised in the parent with the worker's traceback as its cause; a worker that dies by itself (a
decoder segfault, the OOM killer) is a WorkerDied error naming its task and what it was working on. A
cluster distributor (e.g. Ray) would take the same worker and tasks.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

_conn = None  # this process's pipe to the parent, in a worker process only
_send_lock = threading.Lock()  # beats may come from a decoder thread while the main thread sends too


@dataclasses.dataclass(frozen=True)
class Retry:
    """What on_stall returns to run a (changed) task again instead of giving it a result."""

    task: Any


class WorkerDied(RuntimeError):
    """A worker process ended without being asked to (killed by a signal or exited)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (set as the parent's exception's cause)."""

    def __str__(self) -> str:
        return self.args[0]


def heartbeat(label: str, progress: Any = None) -> None:
    """Tell the parent this worker is making progress on `label`; progress (if any) goes to on_progress.
    A no-op outside a worker process, so the worker function also runs inline (tests, a debugger)."""
    if _conn is not None:
        _send(("beat", label, progress))


def _send(message) -> None:
    with _send_lock:
        _conn.send(message)


@dataclasses.dataclass
class _Slot:
    process: multiprocessing.Process
    conn: Any
    generic: bool = False  # started without a worker (a Pool's): each task message carries the worker
    index: int | None = None  # task index in flight, None when idle
    task: Any = None
    label: str = ""
    last_beat: float = 0.0
    closed: bool = False  # the worker's end of the pipe is gone (it died)


class Pool:
    """Forked worker processes kept between distribute() calls; close() (or the with block) stops them.
    Processes are forked when a distribute() call first needs them, so a pool costs nothing until used."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("fork")
        self._idle: list[_Slot] = []
        self._stopping: list[_Slot] = []

    def _lend(self) -> _Slot:
        while self._idle:
            slot = self._idle.pop(0)
            if slot.process.is_alive() and not slot.closed:
                return slot
            _kill(slot)
            slot.conn.close()
        return _start(self._ctx, None)

    def _take_back(self, slots: list[_Slot]) -> None:
        self._idle += slots

    def keep(self, n: int) -> None:
        """Let all but n idle processes exit now (they stop in parallel with what follows; close() joins them)."""
        extra, self._idle = self._idle[n:], self._idle[:n]
        for slot in extra:
            _stop(slot)
        self._stopping += extra

    def close(self) -> None:
        self.keep(0)
        for slot in self._stopping:
            _join(slot)
        self._stopping = []

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def distribute(worker: Callable[[Any], Any], tasks: list, *, processes: int, stall_s: float | None = None,
               on_stall: Callable[[Any, str, float], Any] | None = None,
               on_progress: Callable[[Any], None] | None = None, pool: Pool | None = None) -> Iterator[tuple[int, Any]]:
    """Run worker(task) for every task in `processes` forked processes; yield (task index, result).

    stall_s: seconds without a heartbeat after which a worker is killed and replaced (None: no watchdog).
    on_stall(task, label, waited_s): Retry(task) to run again, else the task's result.
    pool: take the processes from it and give them back at the end (None: fork them here, stop them at the end).
    Use it under contextlib.closing(): leaving the loop early (an error) then stops every worker at once.
    """
    if not tasks:
        return
    ctx = multiprocessing.get_context("fork")
    todo: deque = deque(enumerate(tasks))
    slots: list[_Slot] = []
    finished = False
    try:
        for _ in range(min(processes, len(tasks))):  # each process starts on its task while the next is forked
            slots.append(pool._lend() if pool is not None else _start(ctx, worker))
            _assign(slots[-1], todo, worker)
        while any(s.index is not None for s in slots):
            busy = [s for s in slots if s.index is not None]
            timeout = None
            if stall_s is not None:
                timeout = max(0.0, min(s.last_beat for s in busy) + stall_s - time.monotonic())
            wait([s.conn for s in busy] + [s.process.sentinel for s in busy], timeout)
            for i, slot in enumerate(slots):
                if slot.index is None:
                    continue
                done = _drain(slot, on_progress)
                if done is None and (slot.closed or not slot.process.is_alive()):
                    done = _drain(slot, on_progress)  # what it sent just before it died
                    if done is None:
                        slot.process.join(timeout=10)
                        raise WorkerDied(f"worker pid {slot.process.pid} ended ({_how(slot.process.exitcode)}) while "
                                         f"working on {slot.label} (task {slot.index})")
                if done is not None:
                    yield done
                    _assign(slot, todo, worker)
                elif stall_s is not None and time.monotonic() - slot.last_beat > stall_s:
                    waited = time.monotonic() - slot.last_beat
                    index, task, label = slot.index, slot.task, slot.label
                    _kill(slot)
                    slot.conn.close()
                    # a fresh process replaces the stuck one
                    slots[i] = slot = _start(ctx, None if pool is not None else worker)
                    outcome = on_stall(task, label, waited) if on_stall else None
                    if isinstance(outcome, Retry):
                        todo.appendleft((index, outcome.task))
                    else:
                        yield index, outcome
                    _assign(slot, todo, worker)
        finished = True
    finally:
        if finished and pool is not None:
            pool._take_back([s for s in slots if s.process.is_alive()])
            slots = [s for s in slots if not s.process.is_alive()]
        for slot in slots:
            if finished and slot.process.is_alive():
                _stop(slot)
            else:
                _kill(slot)  # an error or Ctrl-C: stop the other tasks now, their outputs stay unfinished
        for slot in slots:
            _join(slot)


def _start(ctx, worker) -> _Slot:
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_worker_main, args=(child, worker, os.getpid()), daemon=True)
    process.start()
    child.close()
    return _Slot(process=process, conn=parent, generic=worker is None)


def _stop(slot: _Slot) -> None:
    """Ask an idle worker to exit (its loop ends cleanly); _join waits for it."""
    try:
        slot.conn.send(None)
    except OSError:  # already gone
        pass


def _join(slot: _Slot) -> None:
    slot.process.join(timeout=10)
    if slot.process.is_alive():
        _kill(slot)
    slot.conn.close()


def _assign(slot: _Slot, todo: deque, worker) -> None:
    slot.index = slot.task = None
    if todo:
        slot.index, slot.task = todo.popleft()
        slot.label, slot.last_beat = f"task {slot.index}", time.monotonic()
        slot.conn.send((slot.index, slot.task, worker if slot.generic else None))


def _drain(slot: _Slot, on_progress) -> tuple[int, Any] | None:
    """Read every waiting message of a slot; the (index, result) pair when its task finished."""
    while slot.conn.poll():
        try:
            kind, a, b = slot.conn.recv()
        except EOFError:
            slot.closed = True
            return None
        if kind == "beat":
            slot.label, slot.last_beat = a, time.monotonic()
            if b is not None and on_progress is not None:
                on_progress(b)
        elif kind == "done":
            return a, b
        else:  # "error": the worker's exception, with its traceback as the cause
            exc, tb = b
            raise exc from RemoteTraceback(tb)
    return None


def _kill(slot: _Slot) -> None:
    if slot.process.is_alive():
        os.kill(slot.process.pid, signal.SIGKILL)
    slot.process.join(timeout=10)


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _worker_main(conn, worker, parent_pid: int) -> None:
    global _conn
    _conn = conn
    if sys.platform.startswith("linux"):
        # die with the parent: after a kill -9 of the build, an orphan must not keep writing a shard
        # that the rerun is rebuilding
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        message = conn.recv()
        if message is None:
            return
        index, task, fn = message  # fn: the worker of a pool's process (None: the one it was started with)
        try:
            result = (fn or worker)(task)
        except BaseException as e:  # sent to the parent, which raises it: nothing is swallowed here
            tb = "".join(traceback.format_exception(e))
            try:
                pickle.loads(pickle.dumps(e))
            except Exception:  # an exception that cannot travel: its type and text do
                e = RuntimeError(f"{type(e).__name__}: {e}")
            _send(("error", index, (e, tb)))
            continue
        _send(("done", index, result))
