"""How long the dynamic program takes, and what planning long chains on groups
of layers costs against the exact optimum.

Synthetic heterogeneous chains (profiles made up, so only the solver is timed)
at a budget between the smallest feasible peak and keeping everything, without
policies and with a second candidate policy per stretch. Targets (issue 14):
200 layers under 5 s, 400 under 20 s, with policies. Chains longer than
``EXACT_LAYERS`` (100) are planned on 100 groups of adjacent cheap layers;
``test_groups_against_exact`` measures the predicted step time of that plan
against the exact dynamic program's on the same chain and budget.
"""

from __future__ import annotations

import time

import pytest

from bench.workloads import size
from seqckpt.planner import ChainProfile, LayerProfile, Run
from seqckpt.planner.cost import CostModel
from seqckpt.planner.profile import PolicyCost
from seqckpt.planner.solver import fastest_plan, smallest_peak
from seqckpt.policies import COMPUTE_HEAVY


def synthetic_chain(n: int, policies: bool) -> ChainProfile:
    layers = []
    for i in range(n):
        act = (4 - 3 * i // n) * 2**20  # activations shrink with depth
        costs = (
            (PolicyCost(COMPUTE_HEAVY, act * (1 + i % 2) // 2, 4e-4 * (1 + i % 3)),)
            if policies
            else ()
        )
        layers.append(
            LayerProfile(
                name=f"layer{i}",
                forward_time=1e-3 * (1 + i % 3),
                backward_time=2e-3 * (1 + i % 3),
                input_bytes=act,
                output_bytes=act,
                saved_bytes=act * (2 + i % 2),
                held_bytes=act * (1 + i % 2),
                forward_peak_bytes=act * (3 + i % 2),
                nograd_peak_bytes=act * 2,
                backward_peak_bytes=act * 3,
                # what a checkpointed forward leaves (buffer copies, autocast's
                # weight casts): nonzero in real profiles, so timed here too
                region_kept_bytes=act // 16,
                policies=costs,
            )
        )
    return ChainProfile(tuple(layers), "cpu")


def mid_budget(prof: ChainProfile) -> int:
    top = CostModel.of(prof).total((Run(0, len(prof)),))[0]
    return top // 2


@pytest.mark.parametrize("policies", [False, True], ids=["no-policy", "policies"])
@pytest.mark.parametrize("layers", [50, 100, 200, 400])
def test_solve(benchmark, layers: int, policies: bool) -> None:  # type: ignore[no-untyped-def]
    n = min(layers, 12) if size() == "tiny" else layers
    prof = synthetic_chain(n, policies)
    budget = mid_budget(prof)
    benchmark.group = "solver"
    benchmark.extra_info.update(
        variant=f"{n} layers, {'policies' if policies else 'no policy'}",
        budget_bytes=budget,
    )
    plan = benchmark.pedantic(fastest_plan, (prof, budget), rounds=2, iterations=1)
    assert plan.predicted_peak_bytes is not None
    assert plan.predicted_peak_bytes <= budget


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("layers", [150, 200])
def test_groups_against_exact(benchmark, layers: int, fraction: float) -> None:  # type: ignore[no-untyped-def]
    n = 12 if size() == "tiny" else layers
    prof = synthetic_chain(n, policies=True)
    top = CostModel.of(prof).total((Run(0, n),))[0]
    groups = min(100, n - 2)
    # (at the tiny size, 12 layers, 30% of keeping all is below the floor)
    budget = max(int(top * fraction), smallest_peak(prof, groups)[0])
    began = time.perf_counter()
    exact = fastest_plan(prof, budget, exact_up_to=n)
    exact_solve = time.perf_counter() - began
    benchmark.group = "solver-groups"
    grouped = benchmark.pedantic(
        fastest_plan, (prof, budget, 400, groups), rounds=1, iterations=1
    )
    assert exact.predicted_time is not None and grouped.predicted_time is not None
    assert grouped.predicted_peak_bytes <= budget  # type: ignore[operator]
    benchmark.extra_info.update(
        variant=f"{n} layers, budget {fraction:.0%} of keeping all",
        exact_solve_seconds=exact_solve,
        exact_seconds=exact.predicted_time,
        grouped_seconds=grouped.predicted_time,
        loss=grouped.predicted_time / exact.predicted_time - 1,
    )
