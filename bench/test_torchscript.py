"""TorchScript blocks: what running them unoptimised inside regions costs.

seqckpt runs TorchScript inside a checkpointed region with the graph executor's
optimisation off, in the first run and in the recompute (the profiling executor
saves different tensors on a module's first calls than on later ones, so an
optimised recompute could disagree with its forward). This measures the price:
8 scripted blocks of Linear - GELU - Linear - Tanh (width 256, batch 64 on the
CPU; width 1024, batch 4096 on the GPU, where the executor fuses the
elementwise ops):

- ``plain``: the scripted model, optimised executor (TorchScript's default);
- ``plain_unoptimised``: the same with optimisation off, no checkpointing: its
  ``x plain (paired)`` is the cost of the switch alone;
- ``torch_nonreentrant``: every block in torch's checkpoint (optimised), with
  torch's early stop off: with it on (torch's default) the stop exception
  crosses TorchScript as an empty RuntimeError that torch does not recognise,
  and every backward fails;
- ``seqckpt``: every block in ``seqckpt.checkpoint`` (unoptimised inside).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

PAIRS = 11
SIZES = {"cpu": (256, 64), "gpu": (1024, 4096), "tiny": (16, 2)}  # width, batch


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(nn.functional.gelu(self.a(x))))


def unoptimised(model: nn.Sequential, x: Any) -> Any:
    before = torch._C._get_graph_executor_optimize()
    torch._C._set_graph_executor_optimize(False)
    try:
        return model(x)
    finally:
        torch._C._set_graph_executor_optimize(before)


def torch_without_early_stop(block: nn.Module, x: Any) -> Any:
    with tc.set_checkpoint_early_stop(False):
        return tc.checkpoint(block, x, use_reentrant=False)


VARIANTS: dict[str, Callable[[nn.Sequential, Any], Any]] = {
    "plain": lambda model, x: model(x),
    "plain_unoptimised": unoptimised,
    "torch_nonreentrant": every_block(torch_without_early_stop),
    "seqckpt": every_block(seqckpt.checkpoint),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scripted_blocks(benchmark, variant: str) -> None:  # type: ignore[no-untyped-def]
    width, batch = SIZES[size()]
    torch.manual_seed(0)
    model = nn.Sequential(*[torch.jit.script(Block(width)) for _ in range(8)]).to(
        device()
    )
    x = torch.randn(batch, width, device=device(), requires_grad=True)
    forward = VARIANTS[variant]
    benchmark.group = "torchscript-8-blocks"
    info: dict[str, object] = {
        "variant": variant,
        "peak_bytes": peak_bytes(model, x, forward),
    }
    if variant != "plain":
        info["paired_x_plain"] = paired_ratio(
            model, x, forward, VARIANTS["plain"], PAIRS
        )
        info["paired_x_torch"] = paired_ratio(
            model, x, forward, VARIANTS["torch_nonreentrant"], PAIRS
        )
    benchmark.extra_info.update(info)
    run_benchmark(benchmark, model, x, forward)
