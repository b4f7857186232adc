#!/usr/bin/env bash
# The one GPU check: on a fresh GPU machine with only this repository, show that
# gradients match and peak memory drops on CUDA, and measure the benchmarks.
#
#   bash bench/gpu_check.sh [--cpu] [OUT_DIR]
#
# Each step runs on its own, under its own time limit, with its output and error
# text kept in OUT_DIR (default gpu_results/); a failing step does not stop the
# others. The whole run fits in 8 minutes on one H200. A summary table ends it,
# and the exit status is 1 when any step failed. --cpu runs the same steps at
# tiny sizes on the CPU (CI runs it, so the script itself is tested).
#
# Needs: python3 with torch (the machine's CUDA build is used as it is; nothing
# pins the CPU one), pytest, pytest-benchmark and hypothesis for the test and
# benchmark steps. Nothing is downloaded: the repository is put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

mode=gpu
if [[ "${1:-}" == "--cpu" ]]; then
    mode=cpu
    shift
fi
out=${1:-gpu_results}
deadline=${GPU_CHECK_SECONDS:-450}  # every step ends by then: 7.5 minutes
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.tsv"
printf 'step\tstatus\tseconds\tnote\n' > "$summary"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

note() { printf 'gpu_check: %s\n' "$*" >&2; }

# ---------------------------------------------------------------- prerequisites
if ! command -v "$python" > /dev/null; then
    note "no $python on PATH; set PYTHON=/path/to/python with torch installed"
    exit 2
fi
if ! "$python" -c "import torch" 2> "$out/prereq.err"; then
    note "torch does not import in $python (see $out/prereq.err); install a CUDA build of torch"
    exit 2
fi
missing=$("$python" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("pytest", "pytest_benchmark", "hypothesis")
               if importlib.util.find_spec(m) is None))
EOF
)
if [[ "$mode" == gpu ]] && ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    note "torch sees no CUDA device; on a machine without a GPU run: bash bench/gpu_check.sh --cpu"
    exit 2
fi
if [[ -n "$missing" ]]; then
    note "missing Python packages: $missing (pip install $missing); the steps that need them are reported as skipped"
fi

if [[ "$mode" == gpu ]]; then
    device=cuda
    bench_size=gpu
    bench_flag=--gpu
    validate_batch=()
else
    device=cpu
    bench_size=tiny
    bench_flag=
    validate_batch=()  # the models' CPU sizes: small enough, and memory drops
fi

# ------------------------------------------------------------------- one step
# step NAME LIMIT_S NEEDS COMMAND...: run COMMAND with its own time limit,
# stdout to OUT/NAME.txt and stderr to OUT/NAME.err, and add a summary row.
step() {
    local name=$1 limit=$2 needs=$3
    shift 3
    for package in $needs; do
        if [[ " $missing " == *" $package "* ]]; then
            printf '%s\tskipped\t0\tneeds %s\n' "$name" "$package" >> "$summary"
            note "$name: skipped (needs $package)"
            return
        fi
    done
    local left=$((deadline - SECONDS))
    if ((left < 15)); then
        printf '%s\tskipped\t0\tout of time\n' "$name" >> "$summary"
        note "$name: skipped (out of time)"
        return
    fi
    ((limit > left)) && limit=$left
    note "$name ..."
    local start=$SECONDS status
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.txt" 2> "$out/$name.err"
    local code=$?
    case $code in
        0) status=ok ;;
        124 | 137) status="timeout (${limit} s)" ;;
        *) status="failed ($code)" ;;
    esac
    local text
    text=$(tail -n 1 "$out/$name.txt" | tr '\t' ' ' | cut -c1-100)
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$text" >> "$summary"
    note "$name: $status"
}

pytest_opts=(-o addopts= -q -p no:cacheprovider)

step environment 60 "" "$python" - <<EOF
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.version.cuda, "device", "$device")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB")
EOF
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
        >> "$out/environment.txt" 2>> "$out/environment.err"
fi

step cuda_tests 150 "pytest hypothesis" "$python" -m pytest tests -m cuda "${pytest_opts[@]}"
step clients 150 "pytest" "$python" -m pytest tests/test_clients.py "${pytest_opts[@]}"
step validate 90 "" "$python" -m seqckpt validate --model all --device "$device" "${validate_batch[@]}"
step validate_deterministic 90 "" "$python" -m seqckpt validate --model all \
    --device "$device" --deterministic "${validate_batch[@]}"
step validate_json 90 "" "$python" -m seqckpt validate --model all --device "$device" \
    --json "${validate_batch[@]}"
step validate_policy 60 "" "$python" -m seqckpt validate --model gpt --device "$device" \
    --policy compute_heavy "${validate_batch[@]}"

bench() {  # bench NAME LIMIT FILES...: one benchmark file set, JSON and tables
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "pytest pytest_benchmark" env SEQCKPT_BENCH_SIZE="$bench_size" \
        "$python" -m pytest "$@" $bench_flag "${pytest_opts[@]}" --benchmark-enable \
        --benchmark-only --benchmark-min-rounds=3 --benchmark-max-time=0.2 \
        --benchmark-json="$out/$name.json"
    if [[ -f "$out/$name.json" ]]; then
        "$python" bench/report.py "$out/$name.json" > "$out/$name.md" 2>> "$out/$name.err"
    fi
}
bench bench_overhead 60 bench/test_overhead.py
bench bench_suite 150 bench/test_suite.py
bench bench_planner 90 bench/test_planner.py
bench bench_selective 120 bench/test_selective.py
bench bench_shapes 90 bench/test_shapes.py
bench bench_torchscript 60 bench/test_torchscript.py

if [[ "$mode" == gpu ]]; then
    step frontier 90 "" "$python" -m seqckpt plan --model resnet --device cuda \
        --plot "$out/frontier_gpu.png"
    step frontier_gpt 90 "" "$python" -m seqckpt plan --model gpt --device cuda \
        --plot "$out/frontier_gpt_gpu.png"
else
    step frontier 90 "" "$python" -m seqckpt plan --model mlp --device cpu --batch 8
    step frontier_gpt 60 "" "$python" -m seqckpt plan --model gpt --device cpu --batch 1
fi

# -------------------------------------------------------------------- summary
echo
echo "seqckpt GPU check ($mode) - results in $out"
column -t -s $'\t' "$summary" 2> /dev/null || cat "$summary"
awk -F'\t' 'NR > 1 && $2 ~ /^(failed|timeout)/ { bad = 1 } END { exit bad }' "$summary"
