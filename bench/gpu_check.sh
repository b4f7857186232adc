#!/usr/bin/env bash
# One GPU check, under 5 minutes on one GPU: the CUDA tests, validation of every
# embedded model on CUDA (the benchmark suites are CPU-only for now). Everything lands
# in one folder (default: gpu_results/, or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_results}
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$out/device.txt" || true
python -m pytest tests -m cuda -o addopts="" -q -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.txt"
python -m seqckpt validate --model all --device cuda --json > "$out/validate.json"
# The benchmark suites in bench/ still run CPU sizes on the CPU; GPU sizes come
# with the benchmark-suite issue, and their run will be added here then.
echo "results in $out/"
