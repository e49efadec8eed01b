#!/usr/bin/env bash
# Every measurement issue 9 asks for, in ONE device call on one H200 (~10 min; the bench stops starting legs
# when BUDGET_S is spent and lists what it skipped). Run from the repository root on the device:
#
#   OUT=$OUT bash scripts/bench_gpu.sh            # (the device tool sets $OUT; logs and results land there)
#
# Before the call: the device needs this package (pip install --no-index --find-links wheelhouse video-ora,
# see scripts/build_wheelhouse.py) and the plain-stack anchor inside the checkout:
#   mkdir -p shared/anchors && cp ../shared/anchors/plain_stack_step.py shared/anchors/   # untracked: carried
# Optional kernels for the lever legs (each leg that needs a missing one records the refusal and the bench
# goes on): flash-attn, liger-kernel, bitsandbytes, flash-linear-attention (+ triton >= 3.7.1 on Hopper).
#
# What it runs (scripts/bench_train.py --matrix issue9, most important first): the anchor next to train.main
# auto / plain / ZeRO-2 / ZeRO-3 at 64 frames of the Qwen3-VL-4B shape; auto under a 12 GiB cap at 64, 128,
# 256 frames; auto at 512 and 1024 frames; Qwen3-VL-8B and Qwen3.5-9B shapes at 64 frames (fla where it is
# correct, and the torch fallback); then each lever alone at 64 frames. Per leg: step s, tokens/s, MFU, peak
# allocated / reserved GiB per phase with the planner's prediction, data-wait share; OUT/bench/results.md.
set -u
OUT=${OUT:-/tmp/bench_gpu}
BUDGET_S=${BUDGET_S:-540}
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
python -m scripts.bench_train --matrix issue9 --nproc 1 --steps 5 --budget-s "$BUDGET_S" --workers 16 \
  --out "$OUT/bench" --work "$WORK" 2>&1 | tee "$OUT/bench.log"
# the per-leg records that matter (step logs, run.json, memory plans, OOM reports), small enough to come back
for run in "$WORK"/runs/*/; do
  [ -d "$run" ] || continue
  name=$(basename "$run"); mkdir -p "$OUT/legs/$name"
  cp "$run"/run.json "$run"/plan.json "$run"/memory_plan.json "$run"/oom_rank*.json "$OUT/legs/$name/" 2>/dev/null || true
  cp -r "$run"/logs "$OUT/legs/$name/" 2>/dev/null || true
done
