"""How many cores a command keeps busy, over time: /proc/stat sampled every --every seconds while the command runs.

    python -m scripts.cpu_timeline [--every 0.05] -- python -m prep build --videos V --out O ...

Prints one JSON line per sample ({"t_s", "busy_cores"}) and a summary line: the run's wall, CPU seconds of the whole
machine, mean busy cores, and the seconds with fewer than half the cores busy - where a build leaves cores idle
(the fork ramp, the probe stage, the tail of the last shards). Whole-machine counters: run it on an idle machine."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _ticks() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]  # user nice system idle iowait irq softirq steal ...


def _busy_idle() -> tuple[int, int]:
    ticks = _ticks()
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks[:8]) - idle, idle  # user..steal; guest time is already inside user


class MachineLoad:
    """The whole machine's CPU seconds and steal between start() and stop(): what a timed leg shared its cores
    with. machine_cpu_s minus the leg's own CPU seconds is other processes' work; steal_pct is the share of the
    machine's time the hypervisor gave to other guests (a VM's cores running slower than they look)."""

    def start(self) -> None:
        self._t0 = _ticks()

    def stop(self) -> dict:
        d = [b - a for a, b in zip(self._t0, _ticks())]
        tick, total = os.sysconf("SC_CLK_TCK"), sum(d[:8]) or 1
        return {"machine_cpu_s": round((total - d[3] - d[4]) / tick, 2), "steal_pct": round(100 * d[7] / total, 2),
                "mhz": _mean_mhz()}


def _mean_mhz() -> float | None:
    """The cores' mean clock now, as /proc/cpuinfo reports it (a VM may report its nominal clock only)."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    except OSError:
        return None
    return round(sum(mhz) / len(mhz)) if mhz else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=0.05, help="seconds between samples (default 0.05)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given")
    tick = os.sysconf("SC_CLK_TCK")
    cores = os.cpu_count() or 1
    samples = []
    t0 = time.perf_counter()
    last_t, (last_busy, last_idle) = t0, _busy_idle()
    first_busy = last_busy
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        time.sleep(args.every)
        now, (busy, idle) = time.perf_counter(), _busy_idle()
        d = (busy - last_busy) + (idle - last_idle)
        samples.append((now - t0, cores * (busy - last_busy) / d if d else 0.0, now - last_t))
        last_t, last_busy, last_idle = now, busy, idle
    wall = time.perf_counter() - t0
    for t, b, _ in samples:
        print(json.dumps({"t_s": round(t, 3), "busy_cores": round(b, 2)}))
    low = sum(dt for _, b, dt in samples if b < cores / 2)
    print(json.dumps({"summary": {"rc": proc.returncode, "wall_s": round(wall, 3), "cores": cores,
                                  "machine_cpu_s": round((last_busy - first_busy) / tick, 2),
                                  "mean_busy_cores": round((last_busy - first_busy) / tick / wall, 2),
                                  "s_under_half_the_cores": round(low, 3)}}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
