"""Per-checkpoint overhead: every block of a chain is its own checkpoint.

Two chains: 64 tiny blocks (Linear(32, 32) + GELU, batch 8), where the fixed cost
of each checkpoint dominates, and 6 large blocks (Linear(1024, 1024) + GELU,
batch 256), where compute dominates. Each variant runs one training step
(forward, sum, backward) per round.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import seqckpt

Step = Callable[[nn.Module, torch.Tensor], torch.Tensor]

VARIANTS: dict[str, Step] = {
    "plain": lambda block, x: block(x),
    "torch_nonreentrant": lambda block, x: tc.checkpoint(block, x, use_reentrant=False),
    "torch_reentrant": lambda block, x: tc.checkpoint(block, x, use_reentrant=True),
    "seqckpt": lambda block, x: seqckpt.checkpoint(block, x),
}

CHAINS = {
    "tiny64": (64, 32, 8),  # blocks, width, batch
    "large6": (6, 1024, 256),
}


def make_chain(blocks: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)]


def train_step(chain: list[nn.Module], x: torch.Tensor, step: Step) -> None:
    h = x
    for block in chain:
        h = step(block, h)
    h.sum().backward()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chain_name", list(CHAINS))
def test_every_block_checkpointed(benchmark, chain_name: str, variant: str) -> None:
    blocks, width, batch = CHAINS[chain_name]
    chain = make_chain(blocks, width)
    x = torch.randn(batch, width, requires_grad=True)
    benchmark.group = f"overhead-{chain_name}"
    train_step(chain, x, VARIANTS[variant])  # warm up: allocate the .grad fields
    with seqckpt.track_memory("cpu") as mem:
        train_step(chain, x, VARIANTS[variant])
    benchmark.extra_info.update(
        variant=variant, workload=chain_name, peak_bytes=mem.peak_bytes
    )
    benchmark(train_step, chain, x, VARIANTS[variant])
