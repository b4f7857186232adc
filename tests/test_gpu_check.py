"""bench/gpu_check.sh, the one script for a GPU machine, run here with --cpu:
the same steps at tiny sizes on the CPU, so the script itself is tested."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu", str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [
        line.split("\t")
        for line in (tmp_path / "summary.tsv").read_text().splitlines()[1:]
    ]
    steps = {name: status for name, status, *_ in rows}
    assert done.returncode == 0, (steps, done.stderr[-3000:])
    assert set(steps) == {
        "environment", "cuda_tests", "clients", "validate", "validate_deterministic",
        "validate_json", "validate_policy", "bench_overhead", "bench_suite", "bench_planner",
        "bench_selective", "bench_shapes", "bench_torchscript", "frontier",
        "frontier_gpt",
    }  # fmt: skip
    assert all(status == "ok" for status in steps.values()), steps
    assert "bitwise equal" in (tmp_path / "validate.txt").read_text()
    assert "3, compute_heavy" in (tmp_path / "validate_policy.txt").read_text()
    assert (tmp_path / "bench_suite.md").read_text().count("####") >= 5
    assert "seqckpt GPU check (cpu)" in done.stdout  # the summary table


def test_gpu_check_explains_a_missing_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "sees no CUDA device" in done.stderr and "--cpu" in done.stderr
