"""CI does not run the benchmarks (too slow), but every benchmark function runs
once here with tiny sizes (SEQCKPT_BENCH_SIZE=tiny, pytest-benchmark disabled),
so the suites never rot; bench/report.py is run on what they write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench_pytest(*args: str) -> subprocess.CompletedProcess[str]:
    """pytest on the benchmark suites with tiny sizes, in a fresh process."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *args,
            "-q",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
        ],  # fmt: skip
        cwd=ROOT,
        env={**os.environ, "SEQCKPT_BENCH_SIZE": "tiny"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_benchmark_runs_once_with_tiny_sizes() -> None:
    result = run_bench_pytest("bench", "--benchmark-disable")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_report_turns_benchmark_json_into_tables(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    result = run_bench_pytest(
        "bench/test_suite.py", "-k", "large6", "--benchmark-enable",
        "--benchmark-only", "--benchmark-min-rounds=1", "--benchmark-max-time=0.01",
        f"--benchmark-json={out}",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert {b["extra_info"]["variant"] for b in data["benchmarks"]} >= {
        "plain", "torch_nonreentrant", "seqckpt", "planned_at_torch_peak",
    }  # fmt: skip
    table = subprocess.run(
        [sys.executable, "bench/report.py", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "#### suite-large6" in table
    assert "| planned_at_torch_peak |" in table
