"""prep/workers.py: the distributor and its watchdog, with tiny worker functions in real forked processes."""
import os
import signal
import time
from contextlib import closing

import pytest

from prep.workers import Pool, RemoteTraceback, Retry, WorkerDied, distribute, heartbeat


def children() -> set[int]:
    """Live child processes of this one (from /proc), so a test can assert none is left behind."""
    me, out = str(os.getpid()), set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                out.add(int(d))
    return out


def square(x):
    heartbeat(f"item {x}", progress=x)
    return x * x, os.getpid()


def test_every_task_comes_back_with_its_index_and_progress_reaches_the_parent():
    seen = []
    with closing(distribute(square, list(range(7)), processes=3, on_progress=seen.append)) as results:
        got = dict(results)
    assert {i: v for i, (v, _) in got.items()} == {i: i * i for i in range(7)}
    assert len({pid for _, pid in got.values()}) <= 3 and os.getpid() not in {pid for _, pid in got.values()}
    assert sorted(seen) == list(range(7))
    assert not children()


def nap(seconds):
    time.sleep(seconds)
    return os.getpid()


def test_processes_started_first_take_the_next_tasks_while_the_others_start(monkeypatch):
    """Forks are serial in the parent (15-25 ms each from one holding torch): a process that is done gets the next
    task at once instead of waiting for the last fork, no process is started once no task is left for it, and the
    parent then waits for results instead of polling for them."""
    import prep.workers as workers

    start, calls = workers._start, []

    def slow_second_start(ctx, worker):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(1.0)  # the first process finishes its task meanwhile
        return start(ctx, worker)

    monkeypatch.setattr(workers, "_start", slow_second_start)
    cpu = time.process_time()
    with closing(distribute(nap, [0.0, 1.5, 1.5], processes=3)) as results:
        pids = dict(results)
    cpu = time.process_time() - cpu
    assert len(calls) == 2  # the third process was never forked: the first took task 2 while the second started
    assert pids[2] == pids[0] != pids[1]
    assert cpu < 0.5, f"the parent used {cpu:.2f} s of CPU while its workers slept 1.5 s"
    assert not children()


def fail_on_three(x):
    if x == 3:
        raise ValueError(f"bad item {x}")
    return x


def test_a_worker_exception_is_raised_in_the_parent_with_the_worker_traceback():
    with pytest.raises(ValueError, match="bad item 3") as e:
        with closing(distribute(fail_on_three, [1, 2, 3, 4], processes=2)) as results:
            list(results)
    assert isinstance(e.value.__cause__, RemoteTraceback) and "fail_on_three" in str(e.value.__cause__)
    assert not children()


def hang_on(x):
    """x = (value, hang): a hang beats once, then sleeps like a stuck decoder."""
    value, hang = x
    heartbeat(f"video {value}")
    if hang:
        time.sleep(600)
    return value


def test_a_stalled_worker_is_killed_and_replaced_and_on_stall_decides_the_task():
    stalls = []

    def on_stall(task, label, waited):
        stalls.append((task, label, waited))
        return Retry((task[0] * 10, False)) if task[0] == 1 else "gave up"

    t0 = time.monotonic()
    with closing(distribute(hang_on, [(1, True), (2, False), (3, True), (4, False)], processes=1, stall_s=0.5,
                            on_stall=on_stall)) as results:
        got = dict(results)
    # one process: the tasks after each hang ran only because a fresh worker replaced the stuck one
    assert got == {0: 10, 1: 2, 2: "gave up", 3: 4}
    assert [(t, label) for t, label, _ in stalls] == [((1, True), "video 1"), ((3, True), "video 3")]
    assert all(w >= 0.5 for _, _, w in stalls) and time.monotonic() - t0 < 30
    assert not children()


def die(x):
    heartbeat(f"video {x}")
    os.kill(os.getpid(), signal.SIGKILL)  # a decoder segfault or the OOM killer


def test_a_worker_that_dies_is_an_error_naming_what_it_worked_on():
    with pytest.raises(WorkerDied, match=r"killed by SIGKILL\) while working on video 7 \(task 0\)"):
        with closing(distribute(die, [7], processes=1, stall_s=60)) as results:
            list(results)
    assert not children()


def die_first(x):
    """The first task ends its process while the next one's large message is still arriving: the pipe is reset."""
    if x == 0:
        heartbeat("video 0")
        os.kill(os.getpid(), signal.SIGKILL)
    return len(x)


def test_a_worker_that_dies_with_a_task_unread_is_the_same_error_not_a_pipe_error():
    """Two streams: the second task (4 MB) is being sent when the first kills the process. The parent then gets a
    reset or broken pipe instead of end-of-file; that is the worker dying too (a build reported it as an I/O error of
    its output directory: 'Connection reset by peer at stage shards')."""
    with pytest.raises(WorkerDied, match=r"killed by SIGKILL\) while working on .*task 0"):
        with closing(distribute(die_first, [0, b"x" * (4 << 20)], processes=1, streams=2, stall_s=60)) as results:
            list(results)
    assert not children()


class _FinalizedIn:
    """Garbage (a reference cycle) whose finalizer records the process that ran it."""

    def __init__(self, path):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def collect(x):
    import gc

    gc.collect()
    return x


def test_a_worker_never_finalizes_the_garbage_it_inherits(tmp_path):
    """The parent's uncollected garbage (here a cycle with a finalizer) is not collected in a forked worker: a
    decoder left in a cycle by earlier work would otherwise be torn down in a process without its threads."""
    import gc

    gc.disable()  # keep the cycle uncollected until the fork, as a busy parent might
    try:
        _FinalizedIn(tmp_path / "finalized")
        with closing(distribute(collect, [1, 2], processes=2, stall_s=60)) as results:
            assert sorted(r for _, r in results) == [1, 2]
    finally:
        gc.enable()
    gc.collect()  # the parent's own collection finalizes it, once, here
    assert (tmp_path / "finalized").read_text().split() == [str(os.getpid())]


def pid_of(x):
    heartbeat(f"item {x}")
    return os.getpid()


def test_a_pool_serves_two_calls_with_the_same_processes_and_replaces_a_stalled_one():
    with Pool() as pool:
        with closing(distribute(pid_of, list(range(4)), processes=2, pool=pool)) as results:
            first = set(dict(results).values())
        assert len(first) == 2 and children() == first  # still alive between the calls
        with closing(distribute(square, [5, 6], processes=2, pool=pool)) as results:
            assert {v for v, _ in dict(results).values()} == {25, 36}
        with closing(distribute(hang_on, [(1, True), (2, False)], processes=1, stall_s=0.5,
                                on_stall=lambda task, label, waited: "gave up", pool=pool)) as results:
            assert dict(results) == {0: "gave up", 1: 2}
        pool.keep(1)
        with closing(distribute(pid_of, [7], processes=2, pool=pool)) as results:
            assert set(dict(results).values()) <= children()
    assert not children()


def meet(x):
    """x = (folder, name, n): wait (bounded) until n tasks have arrived; which other tasks this one met."""
    folder, name, n = x
    heartbeat(f"item {name}")
    (folder / name).touch()
    deadline = time.monotonic() + 20
    while len(list(folder.iterdir())) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(list(folder.iterdir())), os.getpid()


def test_streams_run_tasks_of_one_process_at_once(tmp_path):
    # 3 tasks that each wait for the other two: they finish at once only if one process runs them together
    with closing(distribute(meet, [(tmp_path, str(i), 3) for i in range(3)], processes=1, streams=3)) as results:
        got = dict(results)
    assert [n for n, _ in got.values()] == [3, 3, 3] and len({pid for _, pid in got.values()}) == 1
    assert not children()


def beats_from_a_thread(x):
    """x = (folder, name, beats, hang): heartbeats only from a read_ahead thread (as the build's decoder does),
    every 0.1 s, then hangs or ends; each run leaves a file, so the test sees which tasks ran twice."""
    from prep.decode import read_ahead

    folder, name, beats, hang = x
    (folder / f"{name}.{len(list(folder.glob(name + '.*')))}").touch()

    def windows():
        for i in range(beats):
            heartbeat(f"video {name}")
            time.sleep(0.1)
            yield i
        while hang:
            time.sleep(600)

    return sum(read_ahead(windows()))


def test_a_stalled_stream_kills_its_process_the_others_run_again_and_beats_from_its_threads_count_for_it(tmp_path):
    stalls = []

    def on_stall(task, label, waited):
        stalls.append(label)
        return "gave up"

    # a hangs at 0.4 s and is caught at ~1.2 s, while b (2 s) still runs and c (0.4 s) is done
    tasks = [(tmp_path, "a", 4, True), (tmp_path, "b", 20, False), (tmp_path, "c", 4, False)]
    with closing(distribute(beats_from_a_thread, tasks, processes=1, streams=3, stall_s=0.8,
                            on_stall=on_stall)) as results:
        got = dict(results)
    assert got == {0: "gave up", 1: sum(range(20)), 2: 6} and stalls == ["video a"]  # 3 streams' beats told apart
    # b was killed with a's process and ran again from the start in the fresh one; c had finished
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.0", "b.0", "b.1", "c.0"]
    assert not children()


def test_loading_runs_without_the_collector_and_leaves_it_as_it_was():
    """prep.workers.loading: the collector is off inside, what was made inside is frozen, and the collector is as it
    was after (on or off). In a fresh interpreter: the collector's state is process-wide."""
    import subprocess
    import sys

    code = (
        "import gc\n"
        "from prep.workers import loading\n"
        "with loading():\n"
        "    assert not gc.isenabled()\n"
        "    kept = [[i] for i in range(20000)]\n"
        "assert gc.isenabled(), 'collector left off'\n"
        "assert gc.get_freeze_count() >= 20000, gc.get_freeze_count()\n"
        "gc.disable()\n"
        "with loading():\n"
        "    pass\n"
        "assert not gc.isenabled(), 'collector turned on'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
