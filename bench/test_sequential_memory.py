"""checkpoint_sequential at equal segment counts: seqckpt vs torch vs plain.

An activation-heavy chain (Linear(64, 64) + GELU blocks on a batch of 2048, so
each block keeps 1 MiB of activations against 16 KiB of weights). Peak bytes of
live tensors during one training step are measured once per variant with
seqckpt.track_memory and stored in extra_info; step time is the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import seqckpt
from seqckpt import track_memory

PAIRS = [(30, 8), (16, 4), (24, 5), (64, 8), (40, 6)]
WIDTH, BATCH = 64, 2048

Run = Callable[[nn.Sequential, int, torch.Tensor], torch.Tensor]
VARIANTS: dict[str, Run] = {
    "plain": lambda m, k, x: m(x),
    "torch_nonreentrant": lambda m, k, x: tc.checkpoint_sequential(
        m, k, x, use_reentrant=False
    ),
    "seqckpt": lambda m, k, x: seqckpt.checkpoint_sequential(m, k, x),
}


def activation_heavy_chain(layers: int, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )


def train_step(model: nn.Sequential, k: int, x: torch.Tensor, run: Run) -> None:
    model.zero_grad(set_to_none=True)
    run(model, k, x).sum().backward()


def peak_bytes(model: nn.Sequential, k: int, x: torch.Tensor, run: Run) -> int:
    train_step(model, k, x, run)  # warm up: allocate .grad once
    model.zero_grad(set_to_none=True)
    with track_memory("cpu") as mem:
        run(model, k, x).sum().backward()
    return mem.peak_bytes


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("layers", "segments"), PAIRS)
def test_segments_memory_and_time(
    benchmark, layers: int, segments: int, variant: str
) -> None:
    model = activation_heavy_chain(layers)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    run = VARIANTS[variant]
    benchmark.group = f"sequential-{layers}layers-{segments}segments"
    benchmark.extra_info.update(
        variant=variant, peak_bytes=peak_bytes(model, segments, x, run)
    )
    benchmark(train_step, model, segments, x, run)
