"""checkpoint_sequential at equal segment counts: seqckpt vs torch vs plain.

An activation-heavy chain (Linear(64, 64) + GELU blocks on a batch of 2048, so
each block keeps 1 MiB of activations against 16 KiB of weights). Peak bytes of
one training step beyond parameters, grads and input are measured once per
variant with seqckpt.track_memory and stored in extra_info, with paired time
ratios (see bench/test_suite.py); step time is the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from bench.workloads import (
    Forward,
    device,
    paired_ratio,
    peak_bytes,
    plain,
    run_benchmark,
    seqckpt_segments,
    size,
    torch_sequential,
)

PAIRS = [(30, 8), (16, 4), (24, 5), (64, 8), (40, 6)]
WIDTH, BATCH = 64, 2048

VARIANTS: dict[str, Callable[[int], Forward]] = {
    "plain": lambda k: plain,
    "torch_nonreentrant": lambda k: torch_sequential(k, reentrant=False),
    "seqckpt": lambda k: seqckpt_segments(k),
}
PAIRS_TIMED = 21


def activation_heavy_chain(layers: int, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("layers", "segments"), PAIRS)
def test_segments_memory_and_time(  # type: ignore[no-untyped-def]
    benchmark, layers: int, segments: int, variant: str
) -> None:
    model = activation_heavy_chain(layers).to(device())
    x = torch.randn(
        16 if size() == "tiny" else BATCH, WIDTH, device=device(), requires_grad=True
    )
    forward = VARIANTS[variant](segments)
    benchmark.group = f"sequential-{layers}layers-{segments}segments"
    info: dict[str, object] = {
        "variant": variant,
        "peak_bytes": peak_bytes(model, x, forward),
    }
    if variant != "plain":
        info["paired_x_plain"] = paired_ratio(model, x, forward, plain, PAIRS_TIMED)
        info["paired_x_torch"] = paired_ratio(
            model, x, forward, VARIANTS["torch_nonreentrant"](segments), PAIRS_TIMED
        )
    benchmark.extra_info.update(info)
    run_benchmark(benchmark, model, x, forward)
