"""A second distributor for the same worker and tasks: one Ray task per task, on every machine of a Ray cluster.

    for index, result in distribute(worker, tasks, address="auto", in_flight=64, stall_s=300, on_stall=...): ...

Same contract as prep.workers.distribute (results in completion order with their task index; use it under
contextlib.closing()), so the build does not know which one runs its shards. Ray is imported here only.

Each Ray task runs `worker(task)` in a forked child of its Ray worker under prep/workers.py's own watchdog (one
process, the same stall_s / on_stall), so a decoder hang on a cluster node is rejected exactly as it is locally,
and the child dies with its Ray worker (PR_SET_PDEATHSIG). The child stays for that Ray worker's next task, as a
local build's processes do: a fresh fork per shard paid ~55 ms of copy-on-write page faults and first calls on a
0.45 CPU s shard (BENCHMARKS.md, Prep). Failures:
  - a Ray worker or node that dies (killed, OOM, lost machine) is retried by Ray: max_retries times;
  - a child that dies by itself (WorkerDied: a decoder segfault, the OOM killer) is retried the same way;
  - any other exception is the task's error, raised here as itself (BuildError, BuildIOError, ...).
A task may therefore run more than once, in part or whole: the worker must be idempotent (the shard writer is:
it clears the shard's final files first, writes under temporary names of its own, renames, stats last).

Waits are bounded: `task_timeout_s` (None: no bound) fails the build when no task has finished for that long;
every ray.wait / ray.get has a timeout. A cluster that cannot run a task (no CPU) is an error before any task.
`address`: "" or None = ray.init()'s default (RAY_ADDRESS, else a cluster already started on this machine,
else a new local one); "auto", "HOST:PORT", "ray://HOST:10001" as ray.init takes them. When this call
started Ray (it was not initialized), it shuts it down at the end.

The fault hooks of prep/faults.py travel with the tasks: VIDEO_ORA_PREP_FAULT(_ONCE) set here are set there.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

from prep import faults
from prep.workers import Pool, WorkerDied
from prep.workers import distribute as local_distribute

MAX_RETRIES = 3
_CHILD = Pool()  # in a Ray worker: its forked child, kept for the worker's next task (run_watched)


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached or cannot run a task."""


def run_watched(worker: Callable[[Any], Any], task: Any, stall_s: float | None,
                on_stall: Callable[[Any, str, float], Any] | None, warm: Callable[[Any], None] | None = None) -> Any:
    """Inside a Ray task: worker(task) in a forked child under the local watchdog; its result.
    warm(task) runs first in the Ray worker itself, so a child forked from it inherits what it loaded (the build
    loads its tokenizer there: ~2 CPU s per shard otherwise, measured on the 2-core box). The child stays for the
    Ray worker's next task (a stalled one is replaced), as a local build's workers do."""
    faults.TASK_PROCESS = os.getpid()  # a kill_worker fault kills this Ray worker, not only the child
    if warm is not None:
        warm(task)
    with closing(local_distribute(worker, [task], processes=1, stall_s=stall_s, on_stall=on_stall,
                                  pool=_CHILD)) as results:
        (_, result), = results
    return result


def connect(address: str | None) -> bool:
    """ray.init(address) unless Ray is initialized in this process already; True when this call started it."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable("--ray needs Ray: pip install 'video-ora[ray]' (ray) on every node") from e
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayUnavailable(f"cannot reach the Ray cluster at {address or 'the default address'}: {e}") from e
    return True


def distribute(worker: Callable[[Any], Any], tasks: list, *, address: str | None = None, in_flight: int | None = None,
               stall_s: float | None = None, on_stall: Callable[[Any, str, float], Any] | None = None,
               num_cpus: float = 1, max_retries: int = MAX_RETRIES, task_timeout_s: float | None = None,
               warm: Callable[[Any], None] | None = None) -> Iterator[tuple[int, Any]]:
    """Run worker(task) for every task as Ray tasks (at most `in_flight` at once; None: all); yield (index, result).
    warm(task): run in the Ray worker process before the task's child is forked (see run_watched)."""
    if not tasks:
        return
    started = connect(address)
    import ray

    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < num_cpus:
            raise RayUnavailable(f"the Ray cluster has {cpus:g} CPUs; a shard task needs {num_cpus:g}")
        env = {k: os.environ[k] for k in (faults.FAULT_ENV, faults.FAULT_ONCE_ENV) if os.environ.get(k)}
        options: dict[str, Any] = {"num_cpus": num_cpus, "max_retries": max_retries, "retry_exceptions": [WorkerDied]}
        if env:
            options["runtime_env"] = {"env_vars": env}
        remote = ray.remote(run_watched).options(**options)
        todo = list(enumerate(tasks))
        todo.reverse()  # pop() takes them in order
        running: dict[Any, int] = {}
        limit = len(tasks) if in_flight is None else max(1, in_flight)
        last = time.monotonic()
        try:
            while todo or running:
                while todo and len(running) < limit:
                    i, task = todo.pop()
                    running[remote.remote(worker, task, stall_s, on_stall, warm)] = i
                done, _ = ray.wait(list(running), num_returns=1, timeout=5.0)
                if not done:
                    if task_timeout_s is not None and time.monotonic() - last > task_timeout_s:
                        raise TimeoutError(f"no Ray task finished in {task_timeout_s:g} s ({len(running)} running, "
                                           f"{len(todo)} waiting)")
                    continue
                last = time.monotonic()
                for ref in done:
                    i = running.pop(ref)
                    yield i, _get(ray, ref)
        finally:
            for ref in running:  # an error or Ctrl-C: stop the others; their shards stay unfinished
                ray.cancel(ref, force=True)
    finally:
        if started:
            ray.shutdown()


def _get(ray, ref) -> Any:
    """ray.get, raising the task's own exception (BuildError, BuildIOError, ...) instead of Ray's wrapper."""
    try:
        return ray.get(ref, timeout=60)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
        if cause is not None:
            raise cause from e
        raise
