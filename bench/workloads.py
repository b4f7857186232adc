"""What the benchmark suites run on, and how each variant runs a training step.

Sizes: ``SEQCKPT_BENCH_SIZE`` is ``cpu`` (default), ``gpu`` (GPU batch sizes, on
CUDA; ``pytest bench --gpu`` sets it) or ``tiny`` (one small step each, for the
smoke test that keeps the suites from rotting).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch
import torch.utils.checkpoint as tc
from torch import nn

import seqckpt
from seqckpt.memory import sync_device, timed
from seqckpt.models import MODELS
from seqckpt.planner import ChainProfile, Plan
from seqckpt.planner.frontier import (
    Forward,
    measure_peak,
    training_step,
)

SIZES = ("cpu", "gpu", "tiny")


def size() -> str:
    value = os.environ.get("SEQCKPT_BENCH_SIZE", "cpu")
    if value not in SIZES:
        raise ValueError(f"SEQCKPT_BENCH_SIZE must be one of {SIZES}, got {value!r}")
    return value


def device() -> torch.device:
    return torch.device("cuda" if size() == "gpu" else "cpu")


def _blocks(n: int, width: int) -> Callable[[], nn.Sequential]:
    def build() -> nn.Sequential:
        return nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)]
        )

    return build


@dataclass(frozen=True)
class Workload:
    """A chain, its sample shape (without batch), batch per size, default k."""

    name: str
    description: str
    build_fn: Callable[[], nn.Sequential]
    shape: tuple[int, ...]
    batch: dict[str, int]
    segments: int

    def build(self) -> nn.Sequential:
        torch.manual_seed(0)
        return self.build_fn().to(device())

    def sample(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn((self.batch[size()], *self.shape), generator=generator)
        # Inputs require grad so torch's reentrant checkpoint gives parameters
        # their gradients too; every variant does the same work.
        return x.to(device()).requires_grad_()


def _from_models(name: str, cpu: int, gpu: int) -> Workload:
    spec = MODELS[name]
    return Workload(
        name,
        spec.description,
        spec.build_fn,
        spec.input_shape,
        {"cpu": cpu, "gpu": gpu, "tiny": 2},
        spec.segments,
    )


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        _from_models("mlp", 512, 16384),
        _from_models("resnet", 32, 256),
        _from_models("transformer", 8, 128),
        _from_models("gpt", 8, 64),
        Workload(
            "tiny64",
            "64 blocks of Linear(32) + GELU, batch 8: overhead-dominated",
            _blocks(64, 32),
            (32,),
            {"cpu": 8, "gpu": 64, "tiny": 2},
            8,
        ),
        Workload(
            "large6",
            "6 blocks of Linear(1024) + GELU, batch 256: compute-dominated",
            _blocks(6, 1024),
            (1024,),
            {"cpu": 256, "gpu": 8192, "tiny": 2},
            3,
        ),
    )
}


def plain(model: nn.Sequential, x: Any) -> Any:
    return model(x)


def torch_sequential(k: int, reentrant: bool) -> Forward:
    def run(model: nn.Sequential, x: Any) -> Any:
        return tc.checkpoint_sequential(model, k, x, use_reentrant=reentrant)

    return run


def every_block(call: Callable[[nn.Module, Any], Any]) -> Forward:
    """Every block of the chain run as ``call(block, x)``, in order."""

    def run(model: nn.Sequential, x: Any) -> Any:
        for block in model:
            x = call(block, x)
        return x

    return run


def seqckpt_every_block(policy: Any) -> Forward:
    """Every block its own seqckpt checkpoint under ``policy``."""
    return every_block(partial(seqckpt.checkpoint, policy=policy))


def seqckpt_segments(segments: int | Plan) -> Forward:
    def run(model: nn.Sequential, x: Any) -> Any:
        return seqckpt.checkpoint_sequential(model, segments, x)

    return run


def peak_bytes(model: nn.Sequential, x: Any, forward: Forward) -> int:
    """Peak bytes one step adds beyond parameters, grads and input (warmed up)."""
    return measure_peak(model, x, forward, device())


@cache
def profile_of(name: str) -> tuple[nn.Sequential, torch.Tensor, ChainProfile]:
    """One model, input and profile per workload for a whole session."""
    workload = WORKLOADS[name]
    model, x = workload.build(), workload.sample()
    return model, x, seqckpt.profile(model, x)


def paired_ratio(
    model: nn.Sequential, x: Any, a: Forward, b: Forward, pairs: int = 15
) -> float:
    """Median over ``pairs`` of time(a) / time(b), each pair measured back to back
    in alternating order, so slow drifts of a shared machine cancel out. At
    tiny sizes (a check that the benchmarks run) two pairs."""
    import statistics

    if size() == "tiny":
        pairs = min(pairs, 2)

    ratios = []
    for i in range(pairs + 1):
        times = {}
        for name, forward in (("a", a), ("b", b)) if i % 2 else (("b", b), ("a", a)):
            step = partial(training_step, model, x, forward)
            times[name] = timed(step, device())[1]
        if i:  # the first pair warms up
            ratios.append(times["a"] / times["b"])
    return statistics.median(ratios)


def run_benchmark(
    benchmark: Any, model: nn.Sequential, x: Any, forward: Forward
) -> None:
    """Time the step with pytest-benchmark (synchronised on CUDA)."""

    def timed() -> None:
        training_step(model, x, forward)
        sync_device(device())

    benchmark(timed)
