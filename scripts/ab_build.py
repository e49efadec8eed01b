"""A/B whole `prep build` runs of two or more source trees on one machine, alternated, with the build's own stages.

    git worktree add /tmp/base <commit>      # or: git archive <commit> | tar x -C /tmp/base
    python -m scripts.ab_build --tree base=/tmp/base --tree new=. --synth 32 --rounds 5 [--workers 16]

Each tree runs in a helper process of its own for the whole comparison (PYTHONPATH = the tree, started once, so
imports and the first build are not timed): a request runs prep.build.build() in it (--overwrite into the same
--out every time, like scripts.bench_prep's build leg). The trees take turns, the order rotating every round after
one untimed round, so a drifting machine load falls on every side alike; the decord floor
(scripts.bench_prep.leg_floor over the same frames) takes its turn too. Per build: wall and CPU seconds (the
helper and every process it forked), build.json's stage timings and the shard commits' summed wall (the tar's
flush, fsync and rename: time a worker's cores wait on the disk); per run, what the whole machine did meanwhile
(scripts.cpu_timeline.MachineLoad: its CPU seconds, the hypervisor's steal, the cores' clock). Printed: one JSON
line per run, then the medians of each side, each side's wall relative to the first tree and to the floor's median,
and paired_vs_floor: the median over rounds of the side's wall over the floor's in the same round, which a host
whose speed drifts during the comparison moves least.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

def serve(videos: Path, annotations: Path, workers: int, samples_per_shard: int, decoder: str, out: Path) -> None:
    """The helper: a build per line read from stdin, a JSON line per build on stdout."""
    import resource

    import prep.build as build_module  # the measured tree's (PYTHONPATH)
    import prep.shards as shards

    def cpu_s() -> float:  # this process and its reaped children: the build joins every worker it forked
        return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))

    log = Path(tempfile.mkdtemp()) / "commits.txt"  # the forked workers append a line per commit
    commit = shards.ShardWriter.commit

    def timed_commit(self):
        t = time.perf_counter()
        result = commit(self)
        with open(log, "a") as f:
            f.write(f"{time.perf_counter() - t:.6f}\n")
        return result

    shards.ShardWriter.commit = timed_commit
    config = build_module.BuildConfig(videos=videos, out=out, annotations=annotations, workers=workers,
                                      samples_per_shard=samples_per_shard, decoder=decoder, progress=False,
                                      overwrite=True)
    for _ in sys.stdin:
        log.write_text("")
        t, c = time.perf_counter(), cpu_s()
        summary = build_module.build(config)
        wall, cpu = time.perf_counter() - t, cpu_s() - c
        commits = [float(x) for x in log.read_text().split()]
        print(json.dumps({"wall_s": round(wall, 3), "cpu_s": round(cpu, 2), **summary["timings_s"],
                          "commits_s": round(sum(commits), 3)}), flush=True)


class Side:
    """One tree's helper process."""

    def __init__(self, name: str, tree: Path, args: argparse.Namespace, videos: Path, annotations: Path, work: Path):
        self.name = name
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
               "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(  # this file as a script: everything it imports comes from `tree`
            [sys.executable, str(Path(__file__).resolve()), "--serve", str(videos), str(annotations),
             str(args.workers), str(args.samples_per_shard), args.decoder, str(work / name)],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self) -> dict:
        self.process.stdin.write("build\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"tree {self.name}: its helper ended (exit {self.process.wait()}); its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def compare(args: argparse.Namespace) -> dict:
    from schemas.manifest import SampleRecord, read_records
    from scripts.bench_prep import LegHelper, cores, issue_videos, write_annotations
    from scripts.cpu_timeline import MachineLoad

    args.workers = args.workers or cores()
    work = Path(tempfile.mkdtemp(prefix="ab-build-"))
    videos = (args.videos or issue_videos(args.cache_dir, args.synth)).resolve()  # the helpers run in their trees
    annotations = work / "annotations.jsonl"
    write_annotations(videos, annotations)
    sides = [Side(name, Path(path).resolve(), args, videos, annotations, work)
             for name, path in (t.split("=", 1) for t in args.tree)]
    floor = LegHelper("floor")
    load = MachineLoad()
    runs: dict[str, list[dict]] = {}
    per_video = None
    try:
        names = [s.name for s in sides] + ["floor"]
        for r in range(args.rounds + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if name == "floor" and per_video is None:
                    continue
                load.start()
                if name == "floor":
                    t = time.perf_counter()
                    _, cpu = floor(per_video, args.workers)
                    row = {"wall_s": round(time.perf_counter() - t, 3), "cpu_s": round(cpu, 2)}
                else:
                    row = next(s for s in sides if s.name == name).run()
                row |= load.stop()
                if name != "floor":
                    if per_video is None:  # the frames every video needs, from the first build's manifest
                        union: dict[str, set[int]] = {}
                        for rec in read_records(work / name / "manifest.parquet", SampleRecord):
                            union.setdefault(str(videos / rec.source_path), set()).update(rec.frame_indices)
                        per_video = {p: sorted(s) for p, s in union.items()}
                print(json.dumps({"side": name, "round": r, **row}), flush=True)
                if r:  # round 0 is untimed
                    runs.setdefault(name, []).append(row)
            if r:  # each side against the floor of its own round: a host whose speed drifts moves both
                for name in names[:-1]:
                    runs[name][-1]["paired_vs_floor"] = round(runs[name][-1]["wall_s"] / runs["floor"][-1]["wall_s"], 3)
    finally:
        for s in sides:
            s.close()
        floor.close()
    medians = {name: {k: round(statistics.median(row[k] for row in runs[name]), 4) for k in runs[name][0]
                      if all(row.get(k) is not None for row in runs[name])} for name in names}
    first = sides[0].name
    for name, m in medians.items():
        m["vs_" + first] = round(m["wall_s"] / medians[first]["wall_s"], 3)
        m["vs_floor"] = round(m["wall_s"] / medians["floor"]["wall_s"], 3)
    return {"workers": args.workers, "decoder": args.decoder, "rounds": args.rounds, "videos": str(videos),
            "medians": medians}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scripts.ab_build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a source tree to build with (its prep/ and schemas/); the first is the reference. One "
                         "tree measures the build against the floor alone")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--videos", type=Path, help="a directory of videos (one annotation per video, no segments)")
    src.add_argument("--synth", type=int, default=32, help="N of issue 10's random-texture clips (default 32)")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "video-ora-bench-videos")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one untimed round)")
    ap.add_argument("--workers", type=int, default=None, help="--workers of every build (default: all cores)")
    ap.add_argument("--samples-per-shard", type=int, default=2, help="default 2: a shard per clip of the issue's set")
    ap.add_argument("--decoder", default="torchcodec")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        videos, annotations, workers, sps, decoder, out = argv[1:]
        serve(Path(videos), Path(annotations), int(workers), int(sps), decoder, Path(out))
        return 0
    result = compare(parser().parse_args(argv))
    for name, m in result["medians"].items():
        print(f"{name}: " + json.dumps(m))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
