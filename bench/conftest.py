"""Shared set-up of the benchmark suites: one thread on CPU, so ratios measured on
a shared machine are not disturbed by the thread pool; ``--gpu`` for GPU sizes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu",
        action="store_true",
        help="run the suites with GPU sizes on CUDA (SEQCKPT_BENCH_SIZE=gpu)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--gpu"):
        os.environ["SEQCKPT_BENCH_SIZE"] = "gpu"
    if os.environ.get("SEQCKPT_BENCH_SIZE") == "gpu" and not torch.cuda.is_available():
        raise pytest.UsageError("--gpu / SEQCKPT_BENCH_SIZE=gpu needs a CUDA device")


def pytest_benchmark_update_machine_info(
    config: pytest.Config, machine_info: dict[str, object]
) -> None:
    """Record what the ratios were measured with, for bench/report.py."""
    machine_info["torch"] = torch.__version__
    machine_info["bench_size"] = os.environ.get("SEQCKPT_BENCH_SIZE", "cpu")
    machine_info["threads"] = 1
    if torch.cuda.is_available():
        machine_info["gpu"] = torch.cuda.get_device_name()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
