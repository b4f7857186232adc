"""Selective saving and the planner with policies, side by side with torch.

GPT-style chain (``seqckpt.models`` "gpt": 8 pre-norm blocks, width 128, 4 heads,
causal attention, GELU MLP; CPU batch 8 x 128 tokens):

- ``per-block``: every block its own checkpoint: torch non-reentrant, torch's
  selective checkpointing keeping the compute-heavy ops (SAC), and seqckpt
  without and with ``policy="compute_heavy"`` (the same choice). Target (issue
  14): seqckpt's no slower than torch's SAC at no more memory. Beside them,
  ``seqckpt_keep_attention``: each block's attention branch kept whole with
  ``seqckpt.keep`` (no dispatch mode), its MLP branch recomputed.
- ``plan-at-torch``: for each torch variant (per-block checkpoint, per-block SAC,
  ``checkpoint_sequential`` k = 2..6), ``seqckpt.plan`` (policies None and
  compute_heavy) with that variant's measured peak as the budget, timed against
  it. Targets: never slower (paired ratio <= 1.0) at no more than 1.02x its peak;
  each row also gives the time over the plain step, ours against torch's.

ResNet-style chain, batch 16, 32 and 64 (``resnet-best-k``): the plan at the
peak of torch's best uniform segment count (the smallest peak over k = 1..14,
ties to the smaller k) against that torch run. Target: at least 17% faster on
average over the three batch sizes (the rotor paper's headline).

Ratios are paired (alternating back-to-back steps, median of the per-pair
ratios), memory is the step's peak beyond parameters, gradients and input.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

import seqckpt
from bench.workloads import (
    Forward,
    device,
    every_block,
    paired_ratio,
    peak_bytes,
    plain,
    profile_of,
    run_benchmark,
    seqckpt_every_block,
    seqckpt_segments,
    size,
    torch_sequential,
)
from seqckpt.models import MODELS
from seqckpt.planner.frontier import torch_every_block, torch_sac_every_block

GPT = "gpt"
PAIRS = 9
# The ratio a target is stated on ("never slower") is measured over more
# pairs: seqckpt and torch running the same schedule differ by about 1.5%,
# which nine pairs on this shared machine cannot resolve.
TARGET_PAIRS = 25
PER_BLOCK: dict[str, Forward] = {
    "plain": plain,
    "torch_nonreentrant": torch_every_block,
    "torch_sac": torch_sac_every_block,
    "seqckpt": seqckpt_every_block(None),
    "seqckpt_compute_heavy": seqckpt_every_block("compute_heavy"),
    "seqckpt_keep_attention": every_block(
        lambda block, x: seqckpt.checkpoint(_keeping_attention, block, x)
    ),
}
TORCH_VARIANTS: dict[str, Forward] = {
    "torch_every_block": torch_every_block,
    "torch_sac_every_block": torch_sac_every_block,
    **{f"torch_sequential_k{k}": torch_sequential(k, False) for k in range(2, 7)},
}


def _keeping_attention(block: Any, x: torch.Tensor) -> torch.Tensor:
    """A GPT block whose attention branch its region keeps (seqckpt.keep):
    the recompute runs the MLP branch only."""
    x = x + seqckpt.keep(block.attention, x)
    out: torch.Tensor = x + block.down(
        torch.nn.functional.gelu(block.up(block.norm2(x)))
    )
    return out


@cache
def gpt_profile() -> tuple[Any, Any, seqckpt.planner.ChainProfile]:
    model, x, _ = profile_of(GPT)
    return model, x, seqckpt.profile(model, x, policies=(None, "compute_heavy"))


@cache
def peak_of(name: str) -> int:
    model, x, _ = profile_of(GPT)
    forward = {**PER_BLOCK, **TORCH_VARIANTS}[name]
    return peak_bytes(model, x, forward)


@pytest.mark.parametrize("variant", list(PER_BLOCK))
def test_per_block(benchmark, variant: str) -> None:  # type: ignore[no-untyped-def]
    model, x, _ = profile_of(GPT)
    forward = PER_BLOCK[variant]
    benchmark.group = "selective-per-block-gpt"
    info: dict[str, Any] = {"variant": variant, "peak_bytes": peak_of(variant)}
    if variant != "plain":
        info["paired_x_plain"] = paired_ratio(model, x, forward, plain, PAIRS)
        info["paired_x_torch"] = paired_ratio(
            model, x, forward, torch_every_block, PAIRS
        )
        info["paired_x_torch_sac"] = paired_ratio(
            model, x, forward, torch_sac_every_block, PAIRS
        )
    benchmark.extra_info.update(info)
    run_benchmark(benchmark, model, x, forward)


@pytest.mark.parametrize("variant", list(TORCH_VARIANTS))
def test_plan_at_torch_peak(benchmark, variant: str) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = gpt_profile()
    budget = peak_of(variant)
    plan = seqckpt.plan(model, x, budget, profile=prof)
    forward = seqckpt_segments(plan)
    theirs = TORCH_VARIANTS[variant]
    ours_x_plain = paired_ratio(model, x, forward, plain, PAIRS)
    theirs_x_plain = paired_ratio(model, x, theirs, plain, PAIRS)
    benchmark.group = "selective-plan-at-torch-gpt"
    benchmark.extra_info.update(
        variant=f"plan at {variant}",
        torch_variant=variant,
        budget_bytes=budget,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        peak_bytes=peak_bytes(model, x, forward),
        paired_x_torch=paired_ratio(model, x, forward, theirs, TARGET_PAIRS),
        overhead_ours=ours_x_plain - 1,
        overhead_torch=theirs_x_plain - 1,
        policies=sorted(
            {
                str(i.policy)
                for i in plan.items
                if isinstance(i, seqckpt.planner.Recompute)
            }
        ),
        plan=str(plan),
    )
    run_benchmark(benchmark, model, x, forward)


RESNET_BATCHES = (16, 32, 64)


@pytest.mark.parametrize("batch", RESNET_BATCHES)
def test_resnet_plan_at_torch_best_k(benchmark, batch: int) -> None:  # type: ignore[no-untyped-def]
    spec = MODELS["resnet"]
    n = 2 if size() == "tiny" else batch
    torch.manual_seed(0)
    model = spec.build().to(device())
    x = spec.sample(device(), n).requires_grad_()
    peaks = {k: peak_bytes(model, x, torch_sequential(k, False)) for k in range(1, 15)}
    best_k = min(peaks, key=lambda k: (peaks[k], k))
    prof = seqckpt.profile(model, x, policies=(None, "compute_heavy"))
    plan = seqckpt.plan(model, x, peaks[best_k], profile=prof)
    forward = seqckpt_segments(plan)
    theirs = torch_sequential(best_k, False)
    benchmark.group = "selective-resnet-best-k"
    benchmark.extra_info.update(
        variant=f"batch {n}: plan at torch k={best_k}",
        best_k=best_k,
        budget_bytes=peaks[best_k],
        peak_bytes=peak_bytes(model, x, forward),
        predicted_peak_bytes=plan.predicted_peak_bytes,
        paired_x_torch=paired_ratio(model, x, forward, theirs, PAIRS),
        paired_x_plain=paired_ratio(model, x, forward, plain, PAIRS),
        plan=str(plan),
    )
    run_benchmark(benchmark, model, x, forward)
