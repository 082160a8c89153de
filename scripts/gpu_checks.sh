#!/usr/bin/env bash
# The checks that need a GPU, as one command for a machine with CUDA (CI has none): the Triton kernels' tests on CUDA
# tensors (tests/test_kernels.py with ATTNRES_TEST_DEVICE=cuda), then the kernel benchmark (benchmarks/kernels.py,
# about 4 minutes). Logs and the benchmark's JSON go to $RESULTS (default benchmarks/results). It installs nothing:
# the Python it runs with must import torch with CUDA, triton and this project's requirements; attnres itself is
# taken from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
results="${RESULTS:-benchmarks/results}"
mkdir -p "$results"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python -c 'import sys, torch
sys.exit(print(torch.cuda.get_device_name()) if torch.cuda.is_available() else "error: no CUDA device (torch sees none)")' \
    || exit 2
status=0
ATTNRES_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k TestKernels 2>&1 \
    | tee "$results/gpu_kernel_tests.log" || status=1
python -m benchmarks.kernels 2>&1 | tee "$results/gpu_kernel_benchmark.log" || status=1
exit "$status"
