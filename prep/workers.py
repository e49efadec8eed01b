"""Worker processes for `prep build`: a distributor that is a plain function taking the worker, and a watchdog.

    for index, result in distribute(worker, tasks, processes=4, stall_s=300, on_stall=...): ...

Each worker process runs `worker(task)` for up to `streams` tasks at once, each in a thread of its own (1 by
default; the build runs several shards per process so that one process keeps its cores busy: decord, PyAV,
torchcodec and the resize + JPEG release the GIL while they work, measured in BENCHMARKS.md, Prep), and a
task reports progress with `heartbeat(label)` (the build beats once per decoded window, naming the video
file). The watchdog times every task by its own beats. A task whose last beat is older than `stall_s` is
stuck (decord 0.6's get_batch hang is the most reported decoder problem): its process is killed with SIGKILL
and replaced by a fresh one, and `on_stall(task, label, waited_s)` decides what the task becomes:
`Retry(task)` runs a changed task (the build drops the stuck video from its shard), anything else is the
task's result. The other tasks that process was running did not stall: they run again from the start (a
worker must be idempotent; the shard writer is). Results come back in completion order with their task index.

Processes are forked (the parent has not opened a decoder); each dies with the parent (PR_SET_PDEATHSIG),
ignores SIGINT (the parent stops everyone on Ctrl-C) and never outlives `distribute`, or, given `pool=Pool()`,
the pool: then the processes stay for the next distribute() call (the build probes and builds its shards with
the same processes) and the worker function travels with each task (it must be picklable: module-level).
Each process gets its first task as soon as it is forked, and a next one as soon as it is done, so the first
ones work through the queue while the parent forks the rest (a fork of a parent holding torch and transformers
costs 15-25 ms, serially in the parent: 16 of them take ~0.3 s, the time of a few probes each). An exception in a
worker is raised in the parent with the worker's traceback as its cause; a worker that dies by itself (a
decoder segfault, the OOM killer) is a WorkerDied error naming its task and what it was working on. A
cluster distributor (e.g. Ray) would take the same worker and tasks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
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
from contextvars import ContextVar
from multiprocessing.connection import wait
from typing import Any

_conn = None  # this process's pipe to the parent, in a worker process only
_send_lock = threading.Lock()  # beats may come from a decoder thread while the main thread sends too
# the task index a thread works for: set in the task's thread; a thread it starts carries it when started in
# a copy of its context (prep.decode.read_ahead does)
_task_index: ContextVar[int | None] = ContextVar("task_index", default=None)
_running: set[int] = set()  # task indices this worker process runs now (their threads add and remove them)


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
    """Tell the parent this task is making progress on `label`; progress (if any) goes to on_progress.
    A no-op outside a worker process, so the worker function also runs inline (tests, a debugger).
    From a thread without the task's context it counts for the process's only task (an error with several)."""
    if _conn is None:
        return
    index = _task_index.get()
    if index is None:
        running = set(_running)
        if len(running) != 1:
            raise RuntimeError(f"heartbeat({label!r}) from a thread that does not carry its task's context, while "
                               f"this worker runs {len(running)} tasks: start the thread in contextvars.copy_context()")
        index = running.pop()
    _send(("beat", index, (label, progress)))


def _send(message) -> None:
    with _send_lock:
        _conn.send(message)


@dataclasses.dataclass
class _Running:
    task: Any
    label: str  # what the task's last beat named
    last_beat: float  # time.monotonic() of it (of the assignment before the first beat)


@dataclasses.dataclass
class _Slot:
    process: multiprocessing.Process
    conn: Any
    generic: bool = False  # started without a worker (a Pool's): each task message carries the worker
    running: dict[int, _Running] = dataclasses.field(default_factory=dict)  # task index -> its state; {}: idle
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


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """The cyclic garbage collector off while a process loads what it keeps to the end (torch, transformers, a
    decoder: millions of objects, collected again and again as they are made), then frozen until the pool's next
    fork unfreezes it. Loading torch, transformers and torchcodec on the 2-core box: 3.43 s, 2.72 s without the
    collector (BENCHMARKS.md, Prep, session 18). The collector is as it was afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def distribute(worker: Callable[[Any], Any], tasks: list, *, processes: int, streams: int = 1,
               stall_s: float | None = None, on_stall: Callable[[Any, str, float], Any] | None = None,
               on_progress: Callable[[Any], None] | None = None, pool: Pool | None = None) -> Iterator[tuple[int, Any]]:
    """Run worker(task) for every task in `processes` forked processes; yield (task index, result).

    streams: tasks each process runs at once, each in a thread (worker must then be thread-safe).
    stall_s: seconds without a heartbeat after which a task's process is killed and replaced (None: no watchdog).
    on_stall(task, label, waited_s): Retry(task) to run again, else the task's result.
    pool: take the processes from it and give them back at the end (None: fork them here, stop them at the end).
    Use it under contextlib.closing(): leaving the loop early (an error) then stops every worker at once.
    """
    if not tasks:
        return
    ctx = multiprocessing.get_context("fork")
    streams = max(1, streams)
    todo: deque = deque(enumerate(tasks))
    slots: list[_Slot] = []
    finished = False
    try:
        starting = min(processes, len(tasks))  # processes still to take from the pool or fork
        level = 1  # tasks a process is given at once while others start: one each before any gets a second
        while (starting and todo) or any(s.running for s in slots):
            if starting and todo:  # one process more, on a task at once; the ones before it work meanwhile
                slots.append(pool._lend() if pool is not None else _start(ctx, worker))
                _assign(slots[-1], todo, worker, 1)
                starting -= 1
            if not todo:  # the ones started took every task: none more is started
                starting = 0
            if not starting and level < streams:  # all started: more tasks each, round robin (few spread evenly)
                level = streams
                for more in range(2, streams + 1):
                    for slot in slots:
                        _assign(slot, todo, worker, more)
            busy = [s for s in slots if s.running]
            timeout = None
            if starting:  # a fork (~15-25 ms from a parent holding torch) is next: only collect what is done
                timeout = 0.0
            elif stall_s is not None:
                oldest = min(r.last_beat for s in busy for r in s.running.values())
                timeout = max(0.0, oldest + stall_s - time.monotonic())
            wait([s.conn for s in busy] + [s.process.sentinel for s in busy], timeout)
            for i, slot in enumerate(slots):
                if not slot.running:
                    continue
                done = _drain(slot, on_progress)
                dead = slot.closed or not slot.process.is_alive()
                if dead:
                    done += _drain(slot, on_progress)  # what it sent just before it died
                    lost = {index: r for index, r in slot.running.items() if index not in dict(done)}
                    if lost:
                        slot.process.join(timeout=10)
                        what = ", ".join(f"{r.label} (task {index})" for index, r in lost.items())
                        raise WorkerDied(f"worker pid {slot.process.pid} ended ({_how(slot.process.exitcode)}) while "
                                         f"working on {what}")
                for index, result in done:
                    slot.running.pop(index, None)
                    yield index, result
                if dead:  # it ended right after its last task: a fresh process takes its place
                    _kill(slot)
                    slot.conn.close()
                    slots[i] = slot = _start(ctx, None if pool is not None else worker)
                now = time.monotonic()
                stalled = [(r.last_beat, index) for index, r in slot.running.items()
                           if stall_s is not None and now - r.last_beat > stall_s]
                if stalled:
                    index = min(stalled)[1]  # the one that stopped first; the others wait on it or are collateral
                    stuck = slot.running.pop(index)
                    waited = now - stuck.last_beat
                    others = list(slot.running.items())
                    _kill(slot)
                    slot.conn.close()
                    # a fresh process replaces the stuck one
                    slots[i] = slot = _start(ctx, None if pool is not None else worker)
                    outcome = on_stall(stuck.task, stuck.label, waited) if on_stall else None
                    for other, r in reversed(others):  # killed with it: they run again, first
                        todo.appendleft((other, r.task))
                    if isinstance(outcome, Retry):
                        todo.appendleft((index, outcome.task))
                    else:
                        yield index, outcome
                _assign(slot, todo, worker, level)
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
    # The child never collects what it inherits: garbage of the parent's (a decoder a caller left in a reference
    # cycle, say) finalized in the child would clean up threads that do not exist there. A shard worker of the test
    # suite, forked from a process that had decoded in earlier tests, died of a segfault while garbage-collecting.
    gc.freeze()
    try:
        process.start()
    finally:
        gc.unfreeze()  # in the parent (and what loading() froze with it: a long-lived caller collects its garbage)
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


def _assign(slot: _Slot, todo: deque, worker, streams: int) -> None:
    """Send the slot's process tasks until it runs `streams` of them (or none is left)."""
    while todo and len(slot.running) < streams:
        index, task = todo.popleft()
        slot.running[index] = _Running(task=task, label=f"task {index}", last_beat=time.monotonic())
        try:
            slot.conn.send((index, task, worker if slot.generic else None))
        except (BrokenPipeError, ConnectionResetError):  # it died before reading: distribute() reports WorkerDied
            slot.closed = True
            return


def _drain(slot: _Slot, on_progress) -> list[tuple[int, Any]]:
    """Read every waiting message of a slot; the (index, result) pairs of the tasks that finished."""
    done = []
    while slot.conn.poll():
        try:
            kind, index, payload = slot.conn.recv()
        except (EOFError, ConnectionResetError):  # reset: it died with a task message of ours still unread
            slot.closed = True
            break
        if kind == "beat":
            label, progress = payload
            if index in slot.running:  # not a task that finished or was killed meanwhile
                slot.running[index].label, slot.running[index].last_beat = label, time.monotonic()
            if progress is not None and on_progress is not None:
                on_progress(progress)
        elif kind == "done":
            done.append((index, payload))
        else:  # "error": the worker's exception, with its traceback as the cause
            exc, tb = payload
            raise exc from RemoteTraceback(tb)
    return done


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
        message = conn.recv()  # the parent sends a task only while this process runs fewer than `streams`
        if message is None:  # sent to an idle process only
            return
        index, task, fn = message  # fn: the worker of a pool's process (None: the one it was started with)
        _running.add(index)
        threading.Thread(target=_run_task, args=(index, task, fn or worker), name=f"task-{index}", daemon=True).start()


def _run_task(index: int, task, worker) -> None:
    """One task in its own thread: its result or its exception goes to the parent."""
    _task_index.set(index)
    try:
        result = worker(task)
    except BaseException as e:  # sent to the parent, which raises it: nothing is swallowed here
        tb = "".join(traceback.format_exception(e))
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:  # an exception that cannot travel: its type and text do
            e = RuntimeError(f"{type(e).__name__}: {e}")
        _finish(index, ("error", index, (e, tb)))
        return
    _finish(index, ("done", index, result))


def _finish(index: int, message) -> None:
    _running.discard(index)  # before the parent hears of it: it may send the next task at once
    _send(message)
