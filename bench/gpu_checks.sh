#!/usr/bin/env bash
# The GPU checks of a session lent a GPU machine (the device tool), in one run:
#   Triton kernels natively (tests/kernels, not the CPU C++ ones), the engine on CUDA against
#   the CPU (tests/engine/test_llm_api.py -k cuda), and bench/gpu_exact.py (bf16 greedy with and
#   without speculation on a 1B-class random Llama). Logs and results go to $OUT (or ./gpu_out).
# Packages the GPU image lacks travel as wheels in .whl/ (pydantic and its parts).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# pyproject maps specd.kernels to kernels/ at install; from a bare tree it needs the link
[ -e specd/kernels ] || ln -s ../kernels specd/kernels
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${KERNELS_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/kernels \
  --ignore=tests/kernels/test_isa_builds.py --ignore=tests/kernels/test_cpu_bf16_matmul.py \
  --ignore=tests/kernels/test_cpu_bf16_ops.py --ignore=tests/kernels/test_cpu_quant_matmul.py 2>&1 | tee "$OUT/kernels.log" | tail -25
timeout "${EXACT_S:-200}" python3 bench/gpu_exact.py --out "$OUT" 2>&1 | tee "$OUT/gpu_exact.log" | tail -25
timeout "${API_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_llm_api.py -k cuda 2>&1 \
  | tee "$OUT/cuda_api.log" | tail -15
