"""Per-checkpoint overhead: every block of a chain is its own checkpoint.

Two chains: 64 tiny blocks (Linear(32, 32) + GELU, batch 8), where the fixed cost
of each checkpoint dominates, and 6 large blocks (Linear(1024, 1024) + GELU,
batch 256), where compute dominates. Each variant runs one training step per
round; ``paired_x_plain`` / ``paired_x_torch`` are paired ratios as in
``bench/test_suite.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import seqckpt
from bench.workloads import (
    device,
    every_block,
    paired_ratio,
    peak_bytes,
    run_benchmark,
    size,
)

Block = Callable[[nn.Module, torch.Tensor], torch.Tensor]

VARIANTS: dict[str, Block] = {
    "plain": lambda block, x: block(x),
    "torch_nonreentrant": lambda block, x: tc.checkpoint(block, x, use_reentrant=False),
    "torch_reentrant": lambda block, x: tc.checkpoint(block, x, use_reentrant=True),
    "seqckpt": lambda block, x: seqckpt.checkpoint(block, x),
}

CHAINS = {
    "tiny64": (64, 32, 8),  # blocks, width, batch
    "large6": (6, 1024, 256),
}
PAIRS = 11


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chain_name", list(CHAINS))
def test_every_block_checkpointed(benchmark, chain_name: str, variant: str) -> None:  # type: ignore[no-untyped-def]
    blocks, width, batch = CHAINS[chain_name]
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)]
    ).to(device())
    x = torch.randn(
        2 if size() == "tiny" else batch, width, device=device(), requires_grad=True
    )
    forward = every_block(VARIANTS[variant])
    benchmark.group = f"overhead-{chain_name}"
    info: dict[str, object] = {
        "variant": variant,
        "workload": chain_name,
        "peak_bytes": peak_bytes(model, x, forward),
    }
    if variant != "plain":
        info["paired_x_plain"] = paired_ratio(
            model, x, forward, every_block(VARIANTS["plain"]), PAIRS
        )
        info["paired_x_torch"] = paired_ratio(
            model, x, forward, every_block(VARIANTS["torch_nonreentrant"]), PAIRS
        )
    benchmark.extra_info.update(info)
    run_benchmark(benchmark, model, x, forward)
