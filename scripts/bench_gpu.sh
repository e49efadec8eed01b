#!/usr/bin/env bash
# Every measurement issue 9 asks for, on one H200, in as few device calls as the 10-minute limit allows (the
# bench stops starting legs when BUDGET_S is spent and lists what it skipped). From the repository root:
#
#   OUT=$OUT SELECT=0-9 bash scripts/bench_gpu.sh     # legs 0..9 of scripts/bench_train.py's issue9 matrix
#   OUT=$OUT SELECT=10- bash scripts/bench_gpu.sh     # the rest, in the next call
#
# Before the call: the packages the image lacks, in one bundle (scripts/device_bundle.sh writes .whl_train/site.tar.xz,
# 46 MiB: transformers, liger-kernel, deepspeed, ninja, av, decord, pydantic, torchcodec, qwen-vl-utils, ...; session
# 14), and the plain-stack anchor inside the checkout:
#   mkdir -p shared/anchors && cp ../shared/anchors/plain_stack_step.py shared/anchors/   # untracked: carried
#   run: carry [".whl_train", "shared"], command starting
#   mkdir -p /tmp/site && tar xJf .whl_train/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
# Qwen3.5 with fla needs Triton >= 3.7.1 on Hopper; its wheel ships no ptxas, so point Triton at the image's
# (resolved before the newer Triton goes on PYTHONPATH):
# To fit the 64 MiB carry, strip Triton's wheel of ptxas-blackwell, cuobjdump, nvdisasm, cupti, proton and
# instrumentation and `strip --strip-unneeded` libtriton.so; keep backends/amd (Triton imports it at start;
# session 8 lost a call without it).
#   export TRITON_PTXAS_PATH=$(PYTHONPATH= python -c "import triton, os; print(os.path.dirname(triton.__file__))")/backends/nvidia/bin/ptxas
# Each leg that needs a missing optional kernel (flash-attn, bitsandbytes, fla) records the refusal and the
# bench goes on.
# Qwen3.5's fla kernels need Triton 3.7.1 stripped as above in a second bundle (~36 MiB, session 10); the two do
# not fit one 64 MiB call: carry the first, then chain a second call within the machine's 30 s warm window carrying
# the second (/tmp and the WORK models survive on the warm machine). Chained calls skip the unpacking: re-export
# PYTHONPATH and PATH and carry only what is new.
#
# What comes back (the device returns at most 8 files): env.txt, plan_predictions.txt, bench.log,
# results.md, results.json, legs.tgz (every leg's log, run.json, plan.json, memory plan, step logs, profile op
# tables) and a profiled leg's Chrome trace (LEG.trace.json.gz, under 15 MB). Two runs in one call exceed 8
# files: give each its own OUT under /tmp and tar them into the call's $OUT (session 15 lost two files so).
set -u
OUT=${OUT:-/tmp/bench_gpu}
BUDGET_S=${BUDGET_S:-480}
SELECT=${SELECT:-}
WORK=${WORK:-/tmp/bench_gpu_work}   # random models (8.9 + 17.5 + 18.8 GB), synthetic shards, run directories
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
{
  date; nvidia-smi || true
  python -c "import torch, transformers, deepspeed, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'peft', peft.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/env.txt" 2>&1
# The planner's answer for the headline cases, before anything runs (no GPU needed; written next to the results).
python - > "$OUT/plan_predictions.txt" 2>&1 <<'PY'
from train.memplan import Workload, candidates, choose
from train.shapes import ModelShape
shape = ModelShape.from_shape_file("qwen3_vl_4b")
for frames, tokens, cap in ((64, 6617, 139), (64, 6617, 12), (128, 13178, 12), (256, 26326, 12), (512, 52695, 139), (1024, 100700, 139)):
    work = Workload.synthetic(frames=frames, tokens_per_group=196, input_tokens=tokens, supervised=15)
    print(f"== {frames} frames, {cap} GiB"); print(choose(shape, work, gpu_mem_gib=cap).message())
PY
python -m scripts.bench_train --matrix issue9 ${SELECT:+--select "$SELECT"} --nproc 1 --steps 5 \
  --budget-s "$BUDGET_S" --workers 16 --out "$WORK/bench" --work "$WORK" 2>&1 | tee "$OUT/bench.log"
cp "$WORK/bench/results.md" "$WORK/bench/results.json" "$OUT/" 2>/dev/null
# the per-leg records that matter (step logs, run.json, memory plans, OOM reports) in one archive
mkdir -p "$WORK/legs"
for run in "$WORK"/runs/*/; do
  [ -d "$run" ] || continue
  name=$(basename "$run"); mkdir -p "$WORK/legs/$name"
  cp "$run"/run.json "$run"/plan.json "$run"/memory_plan.json "$run"/oom_rank*.json "$WORK/legs/$name/" 2>/dev/null
  cp -r "$run"/logs "$WORK/legs/$name/" 2>/dev/null
  cp "$run"/profile/kernels_rank*.txt "$WORK/legs/$name/" 2>/dev/null   # --profile-steps legs: the op table
  [ -f "$run"/profile/rank0.trace.json.gz ] && [ "$(stat -c %s "$run"/profile/rank0.trace.json.gz)" -lt 15000000 ] \
    && cp "$run"/profile/rank0.trace.json.gz "$OUT/$name.trace.json.gz"   # the device returns files < 16 MiB
done
cp "$WORK"/bench/*.log "$WORK/legs/" 2>/dev/null
tar czf "$OUT/legs.tgz" -C "$WORK" legs
