"""The cost model and the dynamic program, on synthetic profiles with known
answers and against brute force over every plan of small chains."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqckpt.planner import (
    ChainProfile,
    Plan,
    PlanError,
    Recompute,
    Run,
    plan_cost,
    uniform_plan,
)
from seqckpt.planner.cost import CostModel
from seqckpt.planner.solver import DEFAULT_SLOTS, fastest_plan, least_memory
from tests.profiles import chain_profile, equal_layers, layer


def all_items(
    start: int, stop: int, whole: bool = True
) -> Iterator[tuple[Run | Recompute, ...]]:
    """Every item sequence covering layers start..stop-1 (one layer per Run);
    ``whole=False`` leaves out one region spanning everything (an inner plan
    that only recomputes itself again)."""
    if start == stop:
        yield ()
        return
    for rest in all_items(start + 1, stop):
        yield (Run(start, start + 1), *rest)
    for cut in range(start + 1, stop + 1 if whole else stop):
        for inner in all_items(start, cut, whole=False):
            for rest in all_items(cut, stop):
                yield (Recompute(start, cut, Plan(inner)), *rest)


def test_brute_force_enumerates_nested_plans() -> None:
    plans = list(all_items(0, 3))
    assert len(set(plans)) == len(plans)
    assert any(
        isinstance(i, Recompute) and i.inner.checkpoints() for p in plans for i in p
    )


def test_keep_everything_when_it_fits() -> None:
    prof = equal_layers(6)
    keep_all = Plan((Run(0, 6),))
    peak, seconds = plan_cost(keep_all, prof)
    plan = fastest_plan(prof, peak)
    assert plan == keep_all
    assert plan.predicted_peak_bytes == peak and plan.predicted_time == seconds
    assert fastest_plan(prof, None) == keep_all


def test_infeasible_budget_names_the_smallest_feasible_one() -> None:
    prof = equal_layers(10)
    floor, _ = least_memory(CostModel.of(prof))
    with pytest.raises(PlanError, match=r"^seqckpt: memory_budget") as info:
        fastest_plan(prof, floor - 1)
    assert str(floor) in str(info.value)
    assert isinstance(info.value, ValueError)
    plan = fastest_plan(prof, floor)
    assert plan.predicted_peak_bytes is not None
    assert plan.predicted_peak_bytes <= floor


def test_least_memory_is_the_minimum_over_all_plans() -> None:
    prof = chain_profile([layer(a) for a in (5000, 4000, 1000, 3000, 500)])
    model = CostModel.of(prof)
    floor, plan = least_memory(model)
    best = min(model.total(items)[0] for items in all_items(0, 5))
    assert floor == best == model.total(plan.items)[0]


def test_equal_layers_at_one_extra_forward_need_about_sqrt_2n() -> None:
    # With every layer recomputed at most once, the best persistent schedule
    # keeps about sqrt(2n) activations (segments of decreasing size), against
    # about 2 sqrt(n) for the best uniform split (Beaumont et al. 2019).
    n, act = 50, 1000
    prof = equal_layers(n, act)
    model = CostModel.of(prof)
    one_extra_forward = sum(model.forward_time) * 2 + sum(model.backward_time)
    floor, _ = least_memory(model)
    units = next(
        u
        for u in range(math.ceil(floor / act), 4 * n)
        if fastest_plan(prof, u * act).predicted_time <= one_extra_forward  # type: ignore[operator]
    )
    uniform_units = min(
        model.total(uniform_plan(n, k).items)[0] / act
        for k in range(1, n + 1)
        if model.total(uniform_plan(n, k).items)[1] <= one_extra_forward
    )
    # The model adds a few constant units: the output gradient, the chain's
    # output (held until backward ends) and the backward's temporaries.
    assert math.sqrt(2 * n) <= units <= math.sqrt(2 * n) + 4
    assert units < uniform_units
    assert uniform_units >= 2 * math.sqrt(n)


@st.composite
def profiles(draw: st.DrawFn) -> tuple[ChainProfile, int]:
    n = draw(st.integers(1, 4))
    layers = [
        layer(
            draw(st.integers(1, 50)) * 1000,
            draw(st.integers(1, 9)) / 4,
            draw(st.integers(1, 9)) / 4,
            saved=draw(st.integers(1, 80)) * 1000,
            # what a recomputed stretch still holds until its recompute
            region_kept=draw(st.sampled_from([0, 0, 1, 7, 20])) * 1000,
            # an output neither it nor the next layer holds (before a ReLU)
            input_held=draw(st.booleans()),
            output_held=draw(st.booleans()),
            # a view of its input (looked through when nothing holds it)
            returns_input=draw(st.booleans()),
            # gradient sums of parameters shared with later layers
            shared_grad=draw(st.sampled_from([0, 0, 0, 5, 30])) * 1000,
        )
        for _ in range(n)
    ]
    prof = chain_profile(layers)
    model = CostModel.of(prof)
    floor, _ = least_memory(model)
    top = model.total((Run(0, n),))[0]
    budget = draw(st.integers(floor, max(floor, top)))
    return prof, budget


def assert_fastest(prof: ChainProfile, budget: int) -> None:
    model = CostModel.of(prof)
    plan = fastest_plan(prof, budget)
    assert plan.predicted_peak_bytes is not None and plan.predicted_time is not None
    assert plan.predicted_peak_bytes <= budget
    # Exact: sizes rounded up to slots lose no plan that fits the budget.
    for items in all_items(0, len(model)):
        need, seconds = model.total(items)
        if need <= budget:
            assert plan.predicted_time <= seconds + 1e-6, (items, need, seconds)


@settings(max_examples=60, deadline=None)
@given(profiles())
def test_dp_matches_brute_force(case: tuple[ChainProfile, int]) -> None:
    assert_fastest(*case)


@st.composite
def profiles_with_casts(draw: st.DrawFn) -> tuple[ChainProfile, int]:
    prof, _ = draw(profiles())
    layers = [
        dataclasses.replace(
            p,
            region_cast_bytes=(cast := draw(st.sampled_from([0, 5, 20, 60])) * 1000),
            region_kept_bytes=p.region_kept_bytes + cast,
        )
        for p in prof.layers
    ]
    prof = chain_profile(layers)
    model = CostModel.of(prof)
    everything = [model.total(items)[0] for items in all_items(0, len(model))]
    top = model.total((Run(0, len(model)),))[0]
    return prof, draw(st.integers(min(everything), max(min(everything), top)))


@settings(max_examples=60, deadline=None)
@given(profiles_with_casts())
def test_with_casts_plans_fit_and_beat_the_bound_that_keeps_them(
    case: tuple[ChainProfile, int],
) -> None:
    # Autocast's casts live until the forward ends: the DP, one memory figure
    # per sub-chain, is exact on two bounds instead (casts kept until the
    # recompute, casts dropped), and the plan is the fastest of theirs that
    # fits. It always fits, and is never slower than the best plan of the
    # upper bound (the model before casts were told apart). It can miss the
    # exact optimum: on random chains of 2 to 5 layers drawn like these, 0.3%
    # to 0.9% of the budgets got a slower plan (by a median 6% to 12%), and
    # the least peak found (the least of the two bounds' least-memory plans)
    # was above the exact least on 17% to 24% of the chains (by a median 7%
    # to 8%), so 2% to 4% of the budgets between the two found no plan.
    prof, budget = case
    model = CostModel.of(prof)
    upper = model.bounds()[0]
    upper_floor, _ = least_memory(upper)
    floor, _ = least_memory(model)
    assert floor <= upper_floor
    try:
        plan = fastest_plan(prof, budget)
    except PlanError:
        assert budget < floor
        return
    assert plan.predicted_peak_bytes is not None and plan.predicted_time is not None
    assert plan.predicted_peak_bytes == model.total(plan.items)[0] <= budget
    for items in all_items(0, len(model)):
        need, seconds = upper.total(items)
        if need <= budget:
            assert plan.predicted_time <= seconds + 1e-6, (items, need, seconds)


def test_a_stretch_holds_the_input_nothing_before_it_holds() -> None:
    # Outputs that neither their layer nor the next one holds (a linear layer
    # before a ReLU): a checkpointed stretch starting there holds its input
    # itself, through its inner plan too (a case hypothesis once found where
    # a DP that left that out of the inner plan's slots failed).
    layers = [
        layer(act, 0.25, 0.25, saved=saved, input_held=False, output_held=False)
        for act, saved in ((1000, 1000), (1000, 3000), (3000, 1000))
    ]
    assert_fastest(chain_profile(layers), 8000)


@pytest.mark.parametrize("n", [8, 14, 30])
def test_a_plan_is_found_at_exactly_its_own_peak(n: int) -> None:
    # Budget = a plan's exact predicted peak (as when the budget is a torch
    # run's measured peak): rounding sizes up to slots must not lose it.
    prof = chain_profile(
        [layer(1000 + 37 * k, 1.0, 2.0, saved=3000 + 101 * k) for k in range(n)]
    )
    for segments in range(2, 6):
        theirs = uniform_plan(n, segments)
        peak, seconds = plan_cost(theirs, prof)
        ours = fastest_plan(prof, peak)
        assert ours.predicted_peak_bytes is not None and ours.predicted_time is not None
        assert ours.predicted_peak_bytes <= peak
        assert ours.predicted_time <= seconds + 1e-9, (segments, str(ours))


def _stretch_squares(items: tuple[Run | Recompute, ...]) -> int:
    return sum(
        (i.stop - i.start) ** 2 + _stretch_squares(i.inner.items)
        for i in items
        if isinstance(i, Recompute)
    )


def test_equally_fast_plans_prefer_the_shortest_stretches() -> None:
    # Same recompute work either way: shorter stretches recompute and run
    # their backward in a smaller working set.
    # A large last layer: its backward sets the peak, and below the budget
    # that keeps a front layer, every way to recompute the front ties.
    n = 5
    prof = chain_profile([layer(1000, saved=10000) for _ in range(n - 1)]
                         + [layer(1000, saved=60000)])  # fmt: skip
    model = CostModel.of(prof)
    everything = [(items, *model.total(items)) for items in all_items(0, n)]
    ties = 0
    for budget in range(63000, 75000, 500):
        plan = fastest_plan(prof, budget)
        fits = [(items, t) for items, need, t in everything if need <= budget]
        best = min(t for _, t in fits)
        tied = [items for items, t in fits if t <= best + 1e-9]
        assert plan.predicted_time is not None
        assert plan.predicted_time <= best + 1e-9
        squares = sorted(set(map(_stretch_squares, tied)))
        assert _stretch_squares(plan.items) == squares[0]
        ties += len(squares) > 1
    assert ties > 0  # the case the test is about did occur


def test_nesting_appears_when_it_pays() -> None:
    # Big early activations, cheap layers: recomputing inside a recompute is
    # the only way to fit a tight budget.
    prof = equal_layers(12)
    floor, _ = least_memory(CostModel.of(prof))
    plan = fastest_plan(prof, floor)
    top_level = sum(isinstance(i, Recompute) for i in plan.items)
    assert plan.checkpoints() > top_level


def all_items_with_policies(
    start: int, stop: int, policies: list[object], whole: bool = True
) -> Iterator[tuple[Run | Recompute, ...]]:
    """Every plan of the planner's space: as :func:`all_items`, with each
    stretch also recomputed flat under each policy (inner plans may hold such
    stretches too)."""
    if start == stop:
        yield ()
        return
    for rest in all_items_with_policies(start + 1, stop, policies):
        yield (Run(start, start + 1), *rest)
    for cut in range(start + 1, stop + 1 if whole else stop):
        rests = list(all_items_with_policies(cut, stop, policies))
        for inner in all_items_with_policies(start, cut, policies, whole=False):
            for rest in rests:
                yield (Recompute(start, cut, Plan(inner)), *rest)
        for policy in policies:
            flat = Recompute(start, cut, Plan((Run(start, cut),)), policy)  # type: ignore[arg-type]
            for rest in rests:
                yield (flat, *rest)


@st.composite
def profiles_with_a_policy(draw: st.DrawFn) -> tuple[object, int]:
    from dataclasses import replace

    from seqckpt.planner.profile import PolicyCost
    from seqckpt.policies import COMPUTE_HEAVY

    prof, _ = draw(profiles())
    layers = []
    for p in prof.layers:  # type: ignore[attr-defined]
        keeps_output = draw(st.booleans())
        kept = draw(st.integers(0, 40)) * 1000 + (p.output_bytes if keeps_output else 0)
        seconds = p.forward_time * draw(st.integers(0, 4)) / 4
        forward = p.forward_time * draw(st.integers(4, 6)) / 4  # choosing costs
        policy = PolicyCost(COMPUTE_HEAVY, kept, seconds, keeps_output, forward)
        layers.append(replace(p, policies=(policy,)))
    prof = type(prof)(tuple(layers), "cpu")  # type: ignore[operator]
    model = CostModel.of(prof)  # type: ignore[arg-type]
    floor, _ = least_memory(model)
    top = model.total((Run(0, len(model)),))[0]
    return prof, draw(st.integers(floor, max(floor, top)))


@settings(max_examples=60, deadline=None)
@given(profiles_with_a_policy())
def test_dp_with_policies_matches_brute_force(case: tuple[object, int]) -> None:
    from seqckpt.policies import COMPUTE_HEAVY

    prof, budget = case
    model = CostModel.of(prof)  # type: ignore[arg-type]
    n = len(model)
    plan = fastest_plan(prof, budget)  # type: ignore[arg-type]
    assert plan.predicted_peak_bytes is not None and plan.predicted_time is not None
    assert plan.predicted_peak_bytes <= budget
    assert (plan.predicted_peak_bytes, plan.predicted_time) == model.total(plan.items)
    # What the slots guarantee: no plan that fits with room for its rounding
    # (one slot per term of its peak) is faster. Closer to the budget a
    # faster sub-plan over its share by less than its rounding can still
    # hide one that fits (a guided search finds such chains; the two kinds
    # the whole chain's choice can see are handled, test below).
    room = budget - (n + 3) * budget / DEFAULT_SLOTS
    for items in all_items_with_policies(0, n, [COMPUTE_HEAVY]):
        need, seconds = model.total(items)
        if need <= room:
            assert plan.predicted_time <= seconds + 1e-6, (items, need, seconds)


def test_a_faster_plan_over_the_budget_hides_no_plan_that_fits() -> None:
    # A chain the brute-force search found (1,500 examples, seed 3): the
    # fastest plan in slots was over the budget, and equally fast or slightly
    # slower plans that fit were never shown to the walk down the table (the
    # table kept the faster one at every number of slots where they fit).
    from dataclasses import replace

    from seqckpt.planner.profile import PolicyCost
    from seqckpt.policies import COMPUTE_HEAVY

    rows = [  # act, f, saved, region_kept, input_held, returns_input,
        # shared_grad; the policy's kept bytes, recompute seconds, whether it
        # keeps the output, its forward's seconds (b = 0.25, output unheld)
        (3000, 0.5, 16000, 0, False, False, 0, 15000, 0.0, True, 0.5),
        (4000, 0.25, 25000, 20000, True, False, 0, 21000, 0.0, False, 0.25),
        (1000, 0.75, 80000, 0, False, True, 0, 0, 0.0, False, 1.125),
        (48000, 0.25, 29000, 0, True, False, 30000, 0, 0.0, False, 0.25),
    ]
    layers = [
        replace(
            layer(
                act,
                f,
                0.25,
                saved=saved,
                region_kept=region_kept,
                input_held=input_held,
                output_held=False,
                returns_input=returns_input,
                shared_grad=shared_grad,
            ),
            policies=(PolicyCost(COMPUTE_HEAVY, kept, seconds, keeps, forward),),
        )
        for (
            act,
            f,
            saved,
            region_kept,
            input_held,
            returns_input,
            shared_grad,
            kept,
            seconds,
            keeps,
            forward,
        ) in rows
    ]
    prof = chain_profile(layers)
    model = CostModel.of(prof)
    budget = 274_000
    plan = fastest_plan(prof, budget)
    fastest = min(
        model.total(items)[1]
        for items in all_items_with_policies(0, len(model), [COMPUTE_HEAVY])
        if model.total(items)[0] <= budget
    )
    assert plan.predicted_time is not None
    assert plan.predicted_time <= fastest + 1e-6


@settings(max_examples=40, deadline=None)
@given(profiles_with_a_policy())
def test_linear_counts_give_each_plans_time_and_a_floor_under_its_peak(
    case: tuple[object, int],
) -> None:
    from seqckpt.policies import COMPUTE_HEAVY

    prof, _ = case
    model = CostModel.of(prof)  # type: ignore[arg-type]
    time_terms, byte_terms = model.linear_terms()
    for items in all_items_with_policies(0, len(model), [COMPUTE_HEAVY]):
        need, seconds = model.total(items)
        time_counts, floor_counts = model.linear_counts(items)
        assert len(time_counts) == len(time_terms)
        assert len(floor_counts) == len(byte_terms)
        dot = sum(c * t for c, t in zip(time_counts, time_terms, strict=True))
        assert math.isclose(dot, seconds, rel_tol=1e-9), items
        floor = sum(c * b for c, b in zip(floor_counts, byte_terms, strict=True))
        assert floor <= need, items


def test_a_policy_is_chosen_where_it_pays() -> None:
    # Recomputing under the policy costs a tenth of a forward and keeps little:
    # at a budget that forces checkpoints, the planner uses it.
    from dataclasses import replace

    from seqckpt.planner.profile import PolicyCost
    from seqckpt.policies import COMPUTE_HEAVY

    prof = equal_layers(12)
    layers = tuple(
        replace(p, policies=(PolicyCost(COMPUTE_HEAVY, 100, p.forward_time / 10),))
        for p in prof.layers
    )
    prof = type(prof)(layers, "cpu")
    model = CostModel.of(prof)
    top = model.total((Run(0, 12),))[0]
    plan = fastest_plan(prof, int(top * 0.6))
    policies = [i.policy for i in plan.items if isinstance(i, Recompute)]
    assert COMPUTE_HEAVY in policies
    without = fastest_plan(
        type(prof)(
            prof.layers and tuple(replace(p, policies=()) for p in layers), "cpu"
        ),
        int(top * 0.6),
    )
    assert plan.predicted_time < without.predicted_time  # type: ignore[operator]


def test_a_policy_whose_forward_costs_more_than_it_saves_is_not_chosen() -> None:
    # The same cheap recompute as above, but choosing what to keep makes the
    # stretch's forward slower by more than the recompute saves.
    from dataclasses import replace

    from seqckpt.planner.profile import PolicyCost
    from seqckpt.policies import COMPUTE_HEAVY

    prof = equal_layers(12)
    top = CostModel.of(prof).total((Run(0, 12),))[0]
    for forward, chosen in ((1.0, True), (3.0, False)):
        cost = PolicyCost(COMPUTE_HEAVY, 100, 0.1, forward_time=forward)
        layers = tuple(replace(p, policies=(cost,)) for p in prof.layers)
        plan = fastest_plan(type(prof)(layers, "cpu"), int(top * 0.6))
        policies = [i.policy for i in plan.items if isinstance(i, Recompute)]
        assert (COMPUTE_HEAVY in policies) is chosen, forward
