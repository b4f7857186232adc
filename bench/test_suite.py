"""The suite: seqckpt against torch.utils.checkpoint and no checkpointing.

Every workload runs every variant; each benchmark times one training step
(forward, a loss-like output gradient, backward) with pytest-benchmark and stores the step's peak bytes
(beyond parameters, their gradients and the input; ``seqckpt.track_memory``) in
``extra_info``. ``k`` is the workload's default segment count.

Variants: ``plain``; torch's ``checkpoint_sequential`` non-reentrant and
reentrant; timm-style ``torch_every_block`` and the same under torch's selective
checkpointing keeping the compute-heavy ops (``torch_sac_every_block``);
``seqckpt`` uniform k; and
``seqckpt.plan`` at three budgets: torch's measured peak at k (equal memory),
and half and a quarter of the plain step's peak (raised to the smallest feasible
budget when below it).

Besides pytest-benchmark's statistics, each variant records ``paired_x_plain``
and ``paired_x_torch``: its step and the reference step timed back to back in
alternating order, median of the per-pair ratios, which a drifting shared
machine disturbs far less than medians taken a minute apart.
"""

from __future__ import annotations

from functools import cache

import pytest

import seqckpt
from bench.workloads import (
    WORKLOADS,
    Forward,
    paired_ratio,
    peak_bytes,
    plain,
    profile_of,
    run_benchmark,
    seqckpt_segments,
    torch_sequential,
)
from seqckpt.planner import PlanError
from seqckpt.planner.frontier import torch_every_block, torch_sac_every_block

FIXED: dict[str, object] = {
    "plain": lambda k: plain,
    "torch_nonreentrant": lambda k: torch_sequential(k, reentrant=False),
    "torch_reentrant": lambda k: torch_sequential(k, reentrant=True),
    "torch_every_block": lambda k: torch_every_block,
    "torch_sac_every_block": lambda k: torch_sac_every_block,
    "seqckpt": lambda k: seqckpt_segments(k),
}
PAIRS = 9
PLANNED = ("planned_at_torch_peak", "planned_at_half_plain", "planned_at_quarter_plain")


@cache
def measured_peak(workload: str, variant: str) -> int:
    model, x, _ = profile_of(workload)
    k = WORKLOADS[workload].segments
    return peak_bytes(model, x, FIXED[variant](k))  # type: ignore[operator]


def planned(workload: str, variant: str) -> tuple[Forward, int, seqckpt.Plan]:
    model, x, prof = profile_of(workload)
    budget = {
        "planned_at_torch_peak": lambda: measured_peak(workload, "torch_nonreentrant"),
        "planned_at_half_plain": lambda: measured_peak(workload, "plain") // 2,
        "planned_at_quarter_plain": lambda: measured_peak(workload, "plain") // 4,
    }[variant]()
    try:
        plan = seqckpt.plan(model, x, budget, profile=prof)
    except PlanError:
        from seqckpt.planner.cost import CostModel
        from seqckpt.planner.solver import least_memory

        budget = least_memory(CostModel.of(prof))[0]
        plan = seqckpt.plan(model, x, budget, profile=prof)
    return seqckpt_segments(plan), budget, plan


@pytest.mark.parametrize("variant", [*FIXED, *PLANNED])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_step(benchmark, workload: str, variant: str) -> None:  # type: ignore[no-untyped-def]
    model, x, _ = profile_of(workload)
    k = WORKLOADS[workload].segments
    benchmark.group = f"suite-{workload}"
    info = {"variant": variant, "workload": workload, "segments": k}
    if variant in FIXED:
        forward = FIXED[variant](k)  # type: ignore[operator]
        info["peak_bytes"] = measured_peak(workload, variant)
    else:
        forward, budget, plan = planned(workload, variant)
        info.update(
            budget_bytes=budget,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            peak_bytes=peak_bytes(model, x, forward),
            checkpoints=plan.checkpoints(),
        )
    if variant != "plain":
        # Robust to a drifting shared machine: alternating back-to-back pairs.
        info["paired_x_plain"] = paired_ratio(model, x, forward, plain, PAIRS)
        info["paired_x_torch"] = paired_ratio(
            model,
            x,
            forward,
            FIXED["torch_nonreentrant"](k),
            PAIRS,  # type: ignore[operator]
        )
    benchmark.extra_info.update(info)
    run_benchmark(benchmark, model, x, forward)
