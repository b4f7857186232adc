#!/usr/bin/env bash
# One GPU check, a few minutes on one GPU: the CUDA tests, validation of every
# embedded model on CUDA, the benchmark suites with GPU sizes (seqckpt vs torch vs
# plain, the planner against uniform segments, the solver) and the planner's
# frontier. Everything lands in one folder (default: gpu_results/, or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_results}
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$out/device.txt" || true
python -m pytest tests -m cuda -o addopts="" -q -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.txt"
python -m seqckpt validate --model all --device cuda --json > "$out/validate.json"
python -m pytest bench/test_suite.py bench/test_planner.py bench/test_solver_speed.py \
    --gpu -o addopts="" -q -p no:cacheprovider --benchmark-enable --benchmark-only \
    --benchmark-min-rounds=5 --benchmark-max-time=0.3 \
    --benchmark-json="$out/bench_gpu.json" > "$out/bench_gpu.txt" 2>&1
python bench/report.py "$out/bench_gpu.json" > "$out/bench_gpu.md"
python -m seqckpt plan --model resnet --device cuda --plot "$out/frontier_gpu.png" \
    > "$out/plan_resnet_gpu.txt"
echo "results in $out/"
