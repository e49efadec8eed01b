"""Kill -9 sweep over `prep build` and over a 2-rank training run; prints the counts (exit 0: all recovered).

    nice -n 10 python -m scripts.fault_matrix --work DIR [--build-kills 12] [--train-kills 6] [--cache-dir DIR]

build  One reference build of synthetic videos (2 workers), its --out watched: every change of the folder's
       (name, size) listing seen by a 5 ms poll is an event (a temp tar appearing or growing, a rename, a
       sidecar, a stats file, the manifest). Then, per kill point i of N, the same command into a fresh --out,
       its whole process group SIGKILLed right after event round(i * E / (N + 1)) of the reference's E (what
       was on disk then is recorded), then rerun to the end. It passes when the rerun exits 0, its
       manifest holds exactly the reference's sample ids, every shard tar and sidecar/manifest parquet is
       byte-identical to the reference (stats.json and build.json differ only by timings, so they are left
       out), `prep verify` exits 0, and no process of the killed build outlived the kill.
train  One uninterrupted reference run: 2 ranks on CPU (gloo), LoRA on the tiny random Qwen3-VL, 6 samples,
       2 epochs of 3 steps, checkpoints step000002 and step000004 (after 2 and 4 of the 6 steps). Then, per
       kill point (TRAIN_KILLS: a rank SIGKILLs itself at an exact place inside the save, VIDEO_ORA_KILL_AT;
       or the whole process group is SIGKILLed once both ranks logged a step), the run, the kill, and
       `--resume` in place. It passes when `latest` does not name an incomplete checkpoint, the resume starts
       from the expected one (fixed for a kill inside the save; for a timed kill, the newest complete one
       after it), every step's sample ids equal the reference's and its loss is within 1e-6, the coverage
       ledger is exact, the adapter equals the reference's (max |diff| <= 1e-6; how many tensors are
       bit-identical is reported), and no rank outlived the kill (torchrun starts each rank in a session of
       its own, so only train.main's tie to its launcher ends them with it).
Every subprocess runs in its own process group with a timeout and is SIGKILLed with its group when it
overruns. `--build-kills 0` or `--train-kills 0` skips a half.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # any one subprocess
LOSS_TOL = 1e-6
ADAPTER_TOL = 1e-6

BUILD_ARGS = ["--window-seconds", "8", "--video-min-tokens", "16", "--video-max-tokens", "64",
              "--samples-per-shard", "3", "--workers", "2", "--no-progress"]
POLL_S = 0.005
TRAIN_BUILD_ARGS = ["--window-seconds", "8", "--video-min-tokens", "16", "--video-max-tokens", "64",
                    "--samples-per-shard", "3", "--workers", "1", "--no-progress"]
TRAIN_ARGS = ["--model-family", "qwen3_vl", "--epochs", "2", "--save-every", "2", "--lr", "1e-3",
              "--num-workers", "1"]
TRAIN_STEPS = 6


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainKill:
    """One way to kill the training run."""

    name: str
    kill_at: str | None = None  # VIDEO_ORA_KILL_AT: a rank kills itself there (train/faults.py)
    after_step: int | None = None  # or: SIGKILL the whole job once every rank logged this global step
    resume_tag: str | None = None  # the checkpoint the resume must start from; None for a timed kill, which
    # cannot know in advance how far the job got: then the newest complete one found after the kill


TRAIN_KILLS = [
    TrainKill(name="rank 1 in save 4: DeepSpeed files written, trainer state not", kill_at="checkpoint_state:4:1",
              resume_tag="step000002"),
    TrainKill(name="rank 0 in save 4: every rank's files written, checkpoint.json not",
              kill_at="checkpoint_marker:4:0", resume_tag="step000002"),
    TrainKill(name="rank 0 in save 4: checkpoint.json written, latest not", kill_at="checkpoint_latest:4:0",
              resume_tag="step000004"),
    TrainKill(name="whole job once step 2 is logged (between checkpoints)", after_step=2),
    TrainKill(name="whole job once step 3 is logged (save 4 follows)", after_step=3),
    TrainKill(name="whole job once step 5 is logged (in the final save)", after_step=5),
]


# ------------------------------------------------------------------------------------------------ processes


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                          "VIDEO_ORA_KILL_AT", "VIDEO_ORA_FAIL_AT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    return env


def _start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start `cmd` in its own process group (so a kill reaches the launcher, every rank and every worker)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, env={**_env(), **(env or {})}, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _finish(proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> int:
    """Wait for the process; past `timeout` its whole group is SIGKILLed and the run counts as failed (-9)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return -signal.SIGKILL
    finally:
        _reap_group(proc)


def _reap_group(proc: subprocess.Popen) -> None:
    """Leave nothing of the group behind (a rank orphaned by its launcher's death, say)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def survivors(marker: str, grace_s: float = 15.0) -> list[int]:
    """Processes whose command line names `marker` (a run or --out path) still alive after `grace_s`; they are
    SIGKILLed. A rank outliving its killed launcher would write beside the rerun (loader workers notice
    their parent's death within 5 s)."""
    me = str(os.getpid())
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or entry.name == me:
                continue
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:  # NUL-separated arguments
                    if b"\0" + marker.encode() + b"\0" in b"\0" + f.read():
                        alive.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def _run(cmd: list[str], log: Path, env: dict | None = None) -> int:
    return _finish(_start(cmd, log, env))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------ build sweep


def write_videos(out: Path, n: int) -> Path:
    from scripts.synth_videos import VideoSpec, write_dataset

    specs = [VideoSpec(name=f"vid_{i}", duration_s=20.0, fps=8.0, width=160, height=96,
                       events=((1.0 + i, 5.5 + i), (12.0, 17.0)), seed=i) for i in range(n)]
    return write_dataset(out, specs)


def build_cmd(videos: Path, out: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "prep", "build", "--videos", str(videos), "--out", str(out), *args]


def compared_files(out: Path) -> dict[str, str]:
    """name -> sha256 of what must be byte-identical: every tar and parquet (stats/build.json hold timings)."""
    return {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.suffix in (".tar", ".parquet")}


def sample_ids(out: Path) -> list[str]:
    from schemas.manifest import SampleRecord, read_records

    return sorted(r.sample_id for r in read_records(out / "manifest.parquet", SampleRecord))


def listing(out: Path) -> tuple:
    try:
        return tuple(sorted((e.name, e.stat().st_size) for e in os.scandir(out)))
    except FileNotFoundError:  # not created yet, or an entry renamed between scandir and stat
        return ()


def on_disk(out: Path) -> str:
    names = [name for name, _ in listing(out)]
    stats = sum(n.endswith(".stats.json") for n in names)
    tmp = sum(".tmp" in n for n in names)
    done = "manifest written" if "manifest.parquet" in names else f"{stats} shards complete"
    return f"{done}, {tmp} temp files"


def watch(proc: subprocess.Popen, out: Path, stop_after: int | None = None) -> int:
    """Count changes of `out`'s listing while `proc` runs; return early once `stop_after` were seen."""
    seen, last = 0, listing(out)
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        now = listing(out)
        if now != last:
            seen, last = seen + 1, now
            if stop_after is not None and seen >= stop_after:
                break
        time.sleep(POLL_S)
    return seen


def build_sweep(work: Path, kills: int) -> dict:
    videos = write_videos(work / "videos", 4)
    ref = work / "build_ref"
    t0 = time.monotonic()
    proc = _start(build_cmd(videos, ref, BUILD_ARGS), work / "logs" / "build_ref.log")
    events = watch(proc, ref)
    rc = _finish(proc)
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"reference build failed (rc {rc}): {work / 'logs' / 'build_ref.log'}")
    ref_ids, ref_files = sample_ids(ref), compared_files(ref)
    print(f"build reference: {len(ref_ids)} samples, {len(ref_files)} compared files, {events} folder events, "
          f"{wall:.2f} s", flush=True)
    rows = []
    for i in range(1, kills + 1):
        target = max(1, round(i * events / (kills + 1)))
        out = work / f"build_kill{i:02d}"
        proc = _start(build_cmd(videos, out, BUILD_ARGS), work / "logs" / f"build_kill{i:02d}.log")
        seen = watch(proc, out, stop_after=target)
        killed = proc.poll() is None
        state = on_disk(out)
        _kill_group(proc)
        _reap_group(proc)
        left = survivors(str(out))
        rerun = _run(build_cmd(videos, out, BUILD_ARGS), work / "logs" / f"build_rerun{i:02d}.log")
        same_ids = rerun == 0 and sample_ids(out) == ref_ids
        identical = rerun == 0 and compared_files(out) == ref_files
        verify = _run([sys.executable, "-m", "prep", "verify", str(out)], work / "logs" / f"build_verify{i:02d}.log")
        row = {"point": i, "after_event": target, "events_seen": seen, "killed": killed, "on_disk_at_kill": state,
               "survivors": len(left), "rerun_rc": rerun, "same_sample_ids": same_ids, "byte_identical": identical,
               "verify_rc": verify, "ok": rerun == 0 and same_ids and identical and verify == 0 and not left}
        rows.append(row)
        print(f"  build kill {i:2d} after event {target}/{events} ({state}{'' if killed else ', had already ended'}): "
              f"rerun rc {rerun}, ids {'=' if same_ids else '!='}, bytes {'=' if identical else '!='}, "
              f"verify rc {verify} -> {'ok' if row['ok'] else 'FAILED'}", flush=True)
        if row["ok"]:
            shutil.rmtree(out)
    return {"kill_points": kills, "killed": sum(r["killed"] for r in rows),
            "recovered": sum(r["rerun_rc"] == 0 for r in rows), "same_sample_ids": sum(r["same_sample_ids"] for r in rows),
            "byte_identical": sum(r["byte_identical"] for r in rows), "verify_clean": sum(r["verify_rc"] == 0 for r in rows),
            "ok": sum(r["ok"] for r in rows), "reference_events": events, "reference_wall_s": round(wall, 2),
            "points": rows}


# ------------------------------------------------------------------------------------------------ train sweep


def train_cmd(shards: Path, run: Path, cache: Path, args: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "train.main",
            "--shards", str(shards), "--output-dir", str(run), "--cache-dir", str(cache), *args, *extra]


def last_steps(run: Path, rank: int) -> dict[int, dict]:
    """global step -> the last logged line for it (a resumed run logs the steps it trains again)."""
    from train.jsonlog import read_log

    return {r["step"]: r for r in read_log(run, rank, "step")}


def _logged_step(run: Path, step: int) -> bool:
    try:
        return all(step in last_steps(run, r) for r in (0, 1))
    except json.JSONDecodeError:  # a line being written
        return False


def adapter_diff(a: Path, b: Path) -> tuple[float, int, int]:
    """(max |a - b| over every adapter tensor, tensors bit-identical, tensors)."""
    from safetensors.torch import load_file

    ta = load_file(str(a / "adapter" / "adapter_model.safetensors"))
    tb = load_file(str(b / "adapter" / "adapter_model.safetensors"))
    if ta.keys() != tb.keys():
        return float("inf"), 0, len(ta)
    diff = max(float((ta[k].float() - tb[k].float()).abs().max()) for k in ta)
    return diff, sum(bool((ta[k] == tb[k]).all()) for k in ta), len(ta)


def compare_run(ref: Path, run: Path) -> list[str]:
    """What differs between a resumed run and the reference (empty: nothing): per rank and step the sample
    ids and the loss, and the coverage ledger's last check of every epoch."""
    from train.jsonlog import read_log

    problems = []
    for r in (0, 1):
        a, b = last_steps(ref, r), last_steps(run, r)
        if sorted(b) != sorted(a):
            problems.append(f"rank {r} logged steps {sorted(b)}, the reference {sorted(a)}")
            continue
        for s in sorted(a):
            if b[s]["sample_ids"] != a[s]["sample_ids"]:
                problems.append(f"rank {r} step {s}: samples {b[s]['sample_ids']} != {a[s]['sample_ids']}")
            elif abs(b[s]["loss"] - a[s]["loss"]) > LOSS_TOL:
                problems.append(f"rank {r} step {s}: loss {b[s]['loss']} != {a[s]['loss']}")
    ledger = {e["epoch"]: e for e in read_log(run, 0, "ledger")}
    epochs = sorted({e["epoch"] for e in read_log(ref, 0, "ledger")})
    if sorted(ledger) != epochs or not all(e["ok"] for e in ledger.values()):
        problems.append(f"coverage ledger: {[(e['epoch'], e['message']) for e in ledger.values()]}")
    return problems


def newest_complete(run: Path) -> str | None:
    from train.checkpoint import ResumeError, find_checkpoint

    try:
        return find_checkpoint(run).tag
    except ResumeError:
        return None


def latest_problem(run: Path) -> str | None:
    from train.checkpoint import CHECKPOINTS, LATEST, checkpoint_problem

    path = run / CHECKPOINTS / LATEST
    tag = path.read_text().strip() if path.is_file() else ""
    why = checkpoint_problem(run / CHECKPOINTS / tag) if tag else None
    return f"after the kill `latest` names {tag}, which is not complete ({why})" if why else None


def train_point(kill: TrainKill, *, shards: Path, ref: Path, run: Path, cache: Path, args: list[str],
                logs: Path) -> dict:
    """Run with `args` into `run`, kill it as `kill` says, resume in place, compare with the finished `ref`
    (the same shards and args, never interrupted)."""
    from train.jsonlog import read_log

    proc = _start(train_cmd(shards, run, cache, args), logs / f"{run.name}.log",
                  env={"VIDEO_ORA_KILL_AT": kill.kill_at} if kill.kill_at else None)
    if kill.after_step is not None:
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None and not _logged_step(run, kill.after_step) and time.monotonic() < deadline:
            time.sleep(0.01)
        killed_rc = -signal.SIGKILL if proc.poll() is None else proc.returncode
        _kill_group(proc)
    else:
        killed_rc = _finish(proc)
    _reap_group(proc)
    logged = [max(last_steps(run, r), default=None) for r in (0, 1)]  # how far each rank got
    left = survivors(str(run))  # torchrun gives each rank its own session: its group is not the ranks'
    after = [max(last_steps(run, r), default=None) for r in (0, 1)]
    expected = kill.resume_tag or newest_complete(run)
    latest = latest_problem(run)  # `latest` must never name a checkpoint that is not complete
    resume_rc = _run(train_cmd(shards, run, cache, args, "--resume", str(run)), logs / f"{run.name}.resume.log")
    resumed = read_log(run, 0, "resume")
    tag = resumed[-1]["checkpoint"] if resumed else None
    skipped = [s["tag"] for s in resumed[-1]["skipped"]] if resumed else []
    problems = [] if resume_rc == 0 else [f"resume rc {resume_rc} (log {logs / f'{run.name}.resume.log'})"]
    if killed_rc == 0:
        problems.append("the run was not killed (it finished first)")
    if tag != expected:
        problems.append(f"resumed from {tag}, expected {expected}")
    if latest:
        problems.append(latest)
    if left:
        problems.append(f"{len(left)} processes of the killed job were still running (killed now): {left}")
    if after != logged:
        problems.append(f"the killed job kept training: last steps {logged} at the kill, {after} after it")
    differs = compare_run(ref, run) if resume_rc == 0 else ["not resumed"]
    diff, exact, total = adapter_diff(ref, run) if resume_rc == 0 else (float("inf"), 0, 0)
    if resume_rc == 0:
        problems += differs
        if diff > ADAPTER_TOL:
            problems.append(f"adapter differs (max |diff| {diff:.3g})")
    return {"name": kill.name, "killed_rc": killed_rc, "survivors": len(left), "last_step_logged": logged,
            "resumed_from": tag,
            "expected": expected, "skipped": skipped,
            "resume_rc": resume_rc, "same_samples_and_losses": not differs, "adapter_max_diff": diff,
            "adapter_bit_identical": f"{exact}/{total}", "problems": problems, "ok": not problems}


def train_sweep(work: Path, kills: list[TrainKill], cache: Path) -> dict:
    from train.models import ensure_tiny_model

    ensure_tiny_model("qwen3_vl", cache)
    shards, logs = work / "train_shards", work / "logs"
    if _run(build_cmd(write_videos(work / "train_videos", 2), shards, TRAIN_BUILD_ARGS), logs / "train_build.log") != 0:
        raise SystemExit(f"training shards failed to build: {logs / 'train_build.log'}")
    ref = work / "train_ref"
    t0 = time.monotonic()
    rc = _run(train_cmd(shards, ref, cache, TRAIN_ARGS), logs / "train_ref.log")
    if rc != 0 or sorted(last_steps(ref, 0)) != list(range(TRAIN_STEPS)):
        raise SystemExit(f"reference training run failed (rc {rc}): {logs / 'train_ref.log'}")
    print(f"train reference: {TRAIN_STEPS} steps on 2 ranks, {time.monotonic() - t0:.1f} s", flush=True)
    rows = []
    for i, kill in enumerate(kills, 1):
        run = work / f"train_kill{i:02d}"
        row = {"point": i, **train_point(kill, shards=shards, ref=ref, run=run, cache=cache, args=TRAIN_ARGS, logs=logs)}
        rows.append(row)
        print(f"  train kill {i}: {kill.name}: killed rc {row['killed_rc']} with steps {row['last_step_logged']} "
              f"logged (ranks 0, 1), resumed from {row['resumed_from']} "
              f"(skipped {row['skipped'] or 'none'}), adapter max |diff| {row['adapter_max_diff']:.3g} "
              f"({row['adapter_bit_identical']} bit-identical) -> "
              f"{'ok' if row['ok'] else 'FAILED: ' + '; '.join(row['problems'])}", flush=True)
        if row["ok"]:
            shutil.rmtree(run)
    return {"kill_points": len(kills), "resumed": sum(r["resume_rc"] == 0 for r in rows),
            "same_samples_and_losses": sum(r["same_samples_and_losses"] for r in rows),
            "equal_adapter": sum(r["adapter_max_diff"] <= ADAPTER_TOL for r in rows), "ok": sum(r["ok"] for r in rows),
            "points": rows}


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.fault_matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (created; passing points are removed)")
    ap.add_argument("--build-kills", type=int, default=12, help="kill points spread over the reference build")
    ap.add_argument("--train-kills", type=int, default=len(TRAIN_KILLS),
                    help=f"the first N of the {len(TRAIN_KILLS)} training kill points")
    ap.add_argument("--cache-dir", type=Path, help="tiny model cache (default WORK/models)")
    args = ap.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    summary: dict = {"event": "fault_matrix"}
    if args.build_kills:
        summary["build"] = build_sweep(work, args.build_kills)
    if args.train_kills:
        summary["train"] = train_sweep(work, TRAIN_KILLS[:args.train_kills], (args.cache_dir or work / "models").resolve())
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (work / "fault_matrix.json").write_text(json.dumps(summary, indent=1))
    for half in ("build", "train"):
        if half in summary:
            counts = {k: v for k, v in summary[half].items() if k != "points"}
            print(f"{half}: {counts['ok']}/{counts['kill_points']} kill points recovered; "
                  + ", ".join(f"{k} {v}" for k, v in counts.items() if k not in ("ok", "kill_points")))
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "points"} if isinstance(v, dict) else v)
                      for k, v in summary.items()}))
    failed = sum(summary[h]["kill_points"] - summary[h]["ok"] for h in ("build", "train") if h in summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
