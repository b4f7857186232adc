"""DDP, FSDP1, FSDP2 and tensor parallelism with checkpointed models: 2 processes on gloo, started here.

Each case spawns two processes on a free localhost port, bounded in time; a
failing or hanging case kills both and fails with the worker's error.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed_workers import TP_POLICIES, WORKERS

TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not built into this torch",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two_ranks(engine: str, kind: str, options: dict[str, Any]) -> None:
    context = mp.start_processes(
        WORKERS[engine],
        args=(_free_port(), kind, options),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{engine} {kind} {options}: no result in {TIMEOUT_S} s"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)


@pytest.mark.parametrize("kind", ["module", "function", "plan", "blocks"])
@pytest.mark.parametrize(
    "options",
    [
        {"find_unused_parameters": False},
        {"find_unused_parameters": True},
        {"static_graph": True},
    ],
    ids=["plain", "find_unused", "static_graph"],
)
def test_ddp_gradients_equal_a_single_process(
    kind: str, options: dict[str, Any]
) -> None:
    run_two_ranks("ddp", kind, options)


@pytest.mark.parametrize("kind", ["module", "plan", "blocks"])
def test_fsdp2_gradients_equal_plain_fsdp2(kind: str) -> None:
    run_two_ranks("fsdp", kind, {})


@pytest.mark.parametrize("kind", ["inside", "wrapper", "around"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_gradients_equal_plain_fsdp1(kind: str, use_orig_params: bool) -> None:
    run_two_ranks("fsdp1", kind, {"use_orig_params": use_orig_params})


@pytest.mark.parametrize("kind", sorted(TP_POLICIES))
def test_tensor_parallel_blocks_under_each_policy_equal_plain(kind: str) -> None:
    # DTensor weights and activations inside the region: a policy's bookkeeping
    # (which kept outputs an in-place op wrote over) and the "values"
    # fingerprints must read DTensors through their local shards.
    run_two_ranks("tp", kind, {})


def test_segments_auto_gives_every_rank_the_same_plan() -> None:
    # Rank 1's budget is smaller: both plan with it and run rank 0's plan.
    run_two_ranks("auto", "module", {"budgets": [200_000, 3_000]})
