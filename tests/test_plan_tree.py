"""The plan tree: builders, validation, display and JSON."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqckpt.planner import (
    Plan,
    PlanError,
    Recompute,
    Run,
    balanced_sizes,
    uniform_plan,
)
from seqckpt.planner.tree import plan_from_sizes


@given(st.integers(1, 200), st.data())
def test_balanced_sizes(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n))
    sizes = balanced_sizes(n, k)
    assert len(sizes) == k and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)


def test_torch_split_is_not_ours() -> None:
    # torch: seven segments of 3 and a plain tail of 9; we: 3,3,4,4,4,4,4,4
    assert balanced_sizes(30, 8) == [3] * 2 + [4] * 6


def test_uniform_plan_shape() -> None:
    plan = uniform_plan(7, 3)
    assert plan.items == (
        Recompute(0, 2, Plan((Run(0, 2),))),
        Recompute(2, 4, Plan((Run(2, 4),))),
        Run(4, 7),
    )
    assert plan.checkpoints() == 2
    plan.check(7)
    with pytest.raises(PlanError, match="^seqckpt: .*8 modules"):
        plan.check(8)


def test_str_shows_the_tree() -> None:
    plan = Plan(
        (
            Recompute(0, 4, Plan((Recompute(0, 2, Plan((Run(0, 2),))), Run(2, 4)))),
            Run(4, 5),
        ),
        predicted_peak_bytes=2**20,
        predicted_time=0.5,
    )
    assert str(plan).splitlines() == [
        "Plan for layers 0-4 (predicted peak 1.00 MiB, predicted step 500.000 ms)",
        "  recompute 0-3",
        "    recompute 0-1",
        "      keep 0-1",
        "    keep 2-3",
        "  keep 4-4",
    ]


@given(st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_json_round_trip(sizes: list[int]) -> None:
    plan = plan_from_sizes(sizes)
    again = Plan.from_json(plan.to_json())
    assert again == plan


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "{}",
        '{"format": "other"}',
        '{"format": "seqckpt.plan/1", "items": []}',
        '{"format": "seqckpt.plan/1", "items": [{"keep": [0]}]}',
        '{"format": "seqckpt.plan/1", "items": [{"keep": [0, 2]}, {"keep": [3, 4]}]}',
        '{"format": "seqckpt.plan/1", "items": [{"skip": [0, 2]}]}',
        '{"format": "seqckpt.plan/1", "items": [{"recompute": [0, 2], "inner": 1}]}',
        '{"format": "seqckpt.plan/1", "items": [{"keep": [0, 1]}], '
        '"predicted_time": "fast"}',
        "[1, 2]",
    ],
)
def test_malformed_json_is_a_plan_error(text: str) -> None:
    with pytest.raises(PlanError, match="^seqckpt: "):
        Plan.from_json(text)
