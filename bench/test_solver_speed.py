"""How long the dynamic program takes: a 100-layer heterogeneous chain (profile
synthesised, so only the solver is timed) at a budget between the smallest
feasible peak and keeping everything. Target (issue 5): under 5 s on one core."""

from __future__ import annotations

import pytest

from bench.workloads import size
from seqckpt.planner import ChainProfile, LayerProfile, Run
from seqckpt.planner.cost import CostModel
from seqckpt.planner.solver import fastest_plan, least_memory


def synthetic_chain(n: int) -> ChainProfile:
    layers = []
    for i in range(n):
        act = (4 - 3 * i // n) * 2**20  # activations shrink with depth
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
            )
        )
    return ChainProfile(tuple(layers), "cpu")


@pytest.mark.parametrize("layers", [100])
def test_solve(benchmark, layers: int) -> None:  # type: ignore[no-untyped-def]
    n = 10 if size() == "tiny" else layers
    prof = synthetic_chain(n)
    model = CostModel.of(prof)
    floor = least_memory(model)[0]
    top = model.total((Run(0, n),))[0]
    budget = (floor + top) // 2
    benchmark.group = "solver"
    benchmark.extra_info.update(variant=f"{n} layers", budget_bytes=budget)
    plan = benchmark.pedantic(fastest_plan, (prof, budget), rounds=3, iterations=1)
    assert plan.predicted_peak_bytes is not None
    assert plan.predicted_peak_bytes <= budget
