#!/usr/bin/env bash
# Issue 10's many-core measurements in one device call (CPU only, ~5 min on the H200 host's 16 cores). From the
# repository root, after unpacking scripts/device_bundle.sh's bundle (decord, av, torchcodec, qwen-vl-utils):
#
#   OUT=$OUT bash scripts/bench_prep_host.sh
#
# 1. scripts/bench_prep over the issue's 32 clips at 1, 4 and 16 workers, once per decoder (build, fetch and
#    floor legs; a shard per clip, as in every table of BENCHMARKS.md since session 4);
# 2. whole builds with the default --samples-per-shard (prep.shards.shard_samples) against the old default (256)
#    and a shard per clip, alternated, at the default --workers (all cores), with build.json's stage timings.
# Ray is not in the bundle (its wheel alone is over the 64 MiB carry), so the Ray leg is the 2-core box's.
# 3. the busy cores over time (scripts/cpu_timeline) during default `prep build` runs with torchcodec, so the idle
#    cores (fork ramp, probe stage, tail) show where the build's wall goes over its CPU / 16; then the parent's
#    imports (python -X importtime), slowest first.
# 4. with BASE_TREE=<a checkout of an earlier commit> (e.g. `mkdir -p .whl_train/base && git archive <commit> prep
#    schemas scripts train | tar x -C .whl_train/base`, carried): scripts/ab_build, that tree against this one, 5
#    alternated rounds at all cores, once per decoder.
# PARTS="1 4" (default "1 2 3 4") runs only those parts: a device call has 600 s, and all four take about that.
# What comes back (8 files, the device's limit): env.txt, bench_<decoder>.txt (table + JSON), bench.log (every run of
# both decoders), shards.txt, timeline.txt, ab_<decoder>.txt (with BASE_TREE).
set -u
OUT=${OUT:-/tmp/bench_prep_host}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
{
  date; nproc; uptime
  python -c "import torch, decord, av, torchcodec; print('torch', torch.__version__, 'decord', decord.__version__, 'av', av.__version__, 'torchcodec', torchcodec.__version__)"
} > "$OUT/env.txt" 2>&1
part() { [[ " ${PARTS:-1 2 3 4} " == *" $1 "* ]]; }
python -c "from pathlib import Path; from scripts.bench_prep import issue_videos
issue_videos(Path('/tmp/video-ora-bench-videos'), 32)"
if part 1; then
for decoder in torchcodec decord; do
  python -m scripts.bench_prep --synth 32 --workers 1 4 16 --repeats 2 --warm-up once --no-markdown \
    --decoder "$decoder" > "$OUT/bench_$decoder.txt" 2>> "$OUT/bench.log"
done
fi
if part 2; then
python - > "$OUT/shards.txt" 2>&1 <<'PY'
import json, resource, statistics, tempfile, time
from pathlib import Path

from prep.build import BuildConfig, build
from scripts.bench_prep import issue_videos, write_annotations

videos = issue_videos(Path(tempfile.gettempdir()) / "video-ora-bench-videos", 32)
annotations = Path(tempfile.mkdtemp()) / "annotations.jsonl"
write_annotations(videos, annotations)


def cpu_s():
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def one(samples_per_shard):
    t, c = time.perf_counter(), cpu_s()
    s = build(BuildConfig(videos=videos, out=Path(tempfile.gettempdir()) / f"shards-{samples_per_shard}",
                          annotations=annotations, samples_per_shard=samples_per_shard, progress=False, overwrite=True))
    return {"wall_s": round(time.perf_counter() - t, 3), "cpu_s": round(cpu_s() - c, 3), "shards": s["shards"],
            "samples_per_shard": s["samples_per_shard"], **{f"{k}_s": v for k, v in s["timings_s"].items()}}


one(None)  # untimed
runs = {}
for rep in range(3):
    for sps in ((None, 256, 2) if rep % 2 == 0 else (2, 256, None)):
        row = one(sps)
        runs.setdefault(str(sps), []).append(row)
        print(json.dumps({"asked": sps, **row}), flush=True)
for sps, rows in runs.items():
    print(f"--samples-per-shard {sps}: {rows[0]['shards']} shards, median wall "
          f"{statistics.median(r['wall_s'] for r in rows):.2f} s, CPU {statistics.median(r['cpu_s'] for r in rows):.2f} s")
PY
fi
VIDEOS=/tmp/video-ora-bench-videos/issue-32
if part 3; then
python - "$VIDEOS" <<'PY'
import sys
from pathlib import Path
from scripts.bench_prep import write_annotations
write_annotations(Path(sys.argv[1]), Path("/tmp/timeline-annotations.jsonl"))
PY
for rep in 1 2 3; do
  python -m scripts.cpu_timeline --every 0.02 -- python -m prep build --videos "$VIDEOS" \
    --annotations /tmp/timeline-annotations.jsonl --out /tmp/timeline-shards --decoder torchcodec --overwrite \
    --no-progress > /tmp/timeline-$rep.txt 2>&1
  python -c "import json; print(json.dumps({'rep': $rep, **{k: json.load(open('/tmp/timeline-shards/build.json'))['summary'][k] for k in ('timings_s', 'shards', 'samples_per_shard')}}))" \
    >> "$OUT/timeline.txt" 2>&1 || true
  tail -1 /tmp/timeline-$rep.txt >> "$OUT/timeline.txt"
done
grep t_s /tmp/timeline-3.txt >> "$OUT/timeline.txt"
# what the ~8 s at one busy core before build() are: the parent's imports, slowest first
python -X importtime -c "import torch, transformers, torchcodec.decoders, decord, av
from transformers import AutoTokenizer" \
  2>&1 | sort -t'|' -k2 -n -r | head -25 >> "$OUT/timeline.txt"
fi
if part 4 && [ -n "${BASE_TREE:-}" ]; then
  for decoder in torchcodec decord; do
    python -m scripts.ab_build --tree "base=$BASE_TREE" --tree new=. --rounds 5 --videos "$VIDEOS" \
      --decoder "$decoder" > "$OUT/ab_$decoder.txt" 2>&1
  done
fi
