#!/usr/bin/env bash
# Megatron-Core's engine on the GPU machine, from the project root (after ../shared/gpu's install.sh):
#     bash tests/gpu/run_engine.sh tests     # the TE training tests on the engine + a real llama3_8b_8l run (cap 420 s)
#     BASELINE=.oldsrc bash tests/gpu/run_engine.sh bench   # one GPU: the engine before (BASELINE checkout) and now
#     bash tests/gpu/run_engine.sh two       # two GPUs: scales across the amax group, safe at PP=2, bench_parallel
#         (10 runs of ~40 s; a second call with LAYOUTS="1gpu dp2 tp2sp pp2 cp2" RECIPES="tensorwise" covers the rest)
# Logs, JSON and PNG into $OUT (default runs/gpu); a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/plugins${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
case "${1:-tests}" in
tests)
  stamp "GPU tests on the engine" | tee "$OUT/tests.log"
  timeout -s INT 300 "$PY" -m pytest tests/gpu/test_te_training.py tests/gpu/test_te_observe.py \
      tests/gpu/test_integrations_gpu.py tests/gpu/test_te_numerics.py -q -p no:cacheprovider -o addopts="" -rfEs \
      2>&1 | tee -a "$OUT/tests.log"
  stamp "scripts/train.py +recipe=safe model=llama3_8b_8l trainer=gpu (distributed optimizer, overlaps on)" \
      | tee "$OUT/train.log"
  timeout -s INT 150 "$PY" scripts/train.py +recipe=safe model=llama3_8b_8l trainer=gpu trainer.max_steps=6 \
      trainer.global_batch_size=8 trainer.save_checkpoints=false trainer.eval_interval=3 trainer.eval_iters=2 \
      trainer.warmup_steps=1 ++recipe.schedule.bf16_warmup_steps=2 \
      "++recipe.schedule.enable={weights:2,activations:3,gradients:4}" run_dir="$OUT/safe8l" 2>&1 \
      | grep -v -E "it/s\]|step/s" | tee -a "$OUT/train.log"
  echo; stamp "summary"
  echo "GPU tests: $(grep -E ' in [0-9.]+s' "$OUT/tests.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -20
  grep -E "^done:|^error" "$OUT/train.log"
  ;;
two)
  stamp "two GPUs: tests/gpu/test_parallel_gpu.py" | tee "$OUT/two.log"
  timeout -s INT 420 "$PY" -m pytest tests/gpu/test_parallel_gpu.py -q -p no:cacheprovider -o addopts="" -rfEs \
      2>&1 | tee -a "$OUT/two.log"
  stamp "two GPUs: bench_parallel" | tee -a "$OUT/two.log"
  timeout -s INT 560 "$PY" scripts/bench_parallel.py --layouts ${LAYOUTS:-1gpu dp2 dp2-plainopt tp2sp pp2} \
      --recipes ${RECIPES:-bf16 delayed} --steps 12 --gbs 8 --out "$OUT" -- model=llama3_8b_8l trainer=gpu \
      trainer.micro_batch_size=2 trainer.warmup_steps=1 2>&1 | tee -a "$OUT/two.log"
  ;;
bench)
  stamp "bench_parallel on one GPU: baseline ${BASELINE:-none} and this engine" | tee "$OUT/bench.log"
  timeout -s INT 560 "$PY" scripts/bench_parallel.py --layouts ${LAYOUTS:-1gpu 1gpu-plainopt} --recipes bf16 delayed \
      --steps 15 --gbs 8 ${BASELINE:+--baseline "$BASELINE"} --out "$OUT" -- model=llama3_8b_8l trainer=gpu \
      trainer.micro_batch_size=2 trainer.warmup_steps=1 2>&1 | tee -a "$OUT/bench.log"
  ;;
esac
