"""seqckpt.plan and segments="auto": predictions, reuse, errors, and that a plan's
measured peak is what it predicted."""

from __future__ import annotations

import copy
import random
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import seqckpt
from seqckpt.models import MODELS
from seqckpt.planner import Plan, PlanError, Recompute, Run, plan_cost
from seqckpt.planner.planning import _AUTO_CACHE, AUTO_STATS
from seqckpt.policies import as_policy
from tests.oracle import assert_matches_plain


@pytest.fixture(scope="module")
def resnet() -> tuple[nn.Sequential, torch.Tensor, seqckpt.planner.ChainProfile]:
    spec = MODELS["resnet"]
    model, x = spec.build(), spec.sample("cpu", batch=8)
    return model, x, seqckpt.profile(model, x, repeats=1)


def measured_peak(model: nn.Module, x: torch.Tensor, plan: Plan) -> int:
    for p in model.parameters():  # grads allocated: not part of the budget
        p.grad = torch.zeros_like(p)
    with seqckpt.track_memory("cpu") as mem:
        seqckpt.checkpoint_sequential(model, plan, x).sum().backward()
    return mem.peak_bytes


def test_plan_reports_predictions_and_fits_the_budget(resnet) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = resnet
    fastest = seqckpt.plan(model, x, None, profile=prof)
    budget = fastest.predicted_peak_bytes // 2
    plan = seqckpt.plan(model, x, budget, profile=prof)
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_time >= fastest.predicted_time
    assert plan.checkpoints() > 0 and fastest.checkpoints() == 0
    assert (plan.predicted_peak_bytes, plan.predicted_time) == plan_cost(plan, prof)
    text = str(plan)
    assert "predicted peak" in text and "recompute" in text and "keep" in text


def test_measured_peak_is_within_5_percent_of_the_prediction(resnet) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = resnet
    top = seqckpt.plan(model, x, None, profile=prof).predicted_peak_bytes
    for share in (1.0, 0.7, 0.5, 0.4):
        budget = int(top * share)
        try:
            plan = seqckpt.plan(model, x, budget, profile=prof)
        except PlanError:
            continue
        peak = measured_peak(model, x, plan)
        # the model errs on the safe side: hardly ever above, never far below
        assert abs(peak - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes
        assert peak <= 1.01 * budget


def test_planned_run_is_bitwise_the_plain_run(resnet) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = resnet
    floor = seqckpt.plan(model, x, None, profile=prof).predicted_peak_bytes // 3
    plan = seqckpt.plan(model, x, floor * 2, profile=prof)
    assert any(isinstance(i, Recompute) for i in plan.items)
    assert_matches_plain(
        copy.deepcopy(model),
        x,
        lambda m, t: seqckpt.checkpoint_sequential(m, plan, t),
    )
    wrapped = seqckpt.CheckpointedSequential.from_sequential(
        copy.deepcopy(model), segments=plan
    )
    assert_matches_plain(
        wrapped, x, lambda m, t: m(t), plain=lambda m, t: nn.Sequential.forward(m, t)
    )


def test_plan_json_round_trip_keeps_predictions(resnet) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = resnet
    plan = seqckpt.plan(model, x, "12MiB", profile=prof)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.predicted_peak_bytes == plan.predicted_peak_bytes
    assert again.predicted_time == plan.predicted_time


def test_infeasible_budget_raises_plan_error_with_the_floor(resnet) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = resnet
    with pytest.raises(PlanError, match="smallest peak") as info:
        seqckpt.plan(model, x, "1KiB", profile=prof)
    assert isinstance(info.value, ValueError)
    floor = int(str(info.value).split("for this chain and input, ")[1].split()[0])
    assert seqckpt.plan(model, x, floor, profile=prof).predicted_peak_bytes <= floor


def test_plan_argument_errors(resnet) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = resnet
    with pytest.raises(PlanError, match="profile has 14 layers"):
        seqckpt.plan(list(model)[:5], x, profile=prof)
    with pytest.raises(TypeError, match="seqckpt: profile must be"):
        seqckpt.plan(model, x, profile={"layers": []})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seqckpt: memory_budget"):
        seqckpt.plan(model, x, -5, profile=prof)
    with pytest.raises(ValueError, match="seqckpt: slots"):
        seqckpt.plan(model, x, profile=prof, slots=0)


def test_segments_auto_plans_once_and_matches_plain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]
    )
    x = torch.randn(128, 64, requires_grad=True)
    assert_matches_plain(
        model,
        x,
        lambda m, t: seqckpt.checkpoint_sequential(
            m, "auto", t, memory_budget="250KiB"
        ),
    )
    _AUTO_CACHE.clear()
    before = AUTO_STATS.profiles
    for _ in range(2):
        seqckpt.checkpoint_sequential(model, "auto", x, memory_budget="250KiB")
    profiles = AUTO_STATS.profiles
    assert profiles == before + 1  # profiled once, then reused
    assert len(_AUTO_CACHE) == 1
    ((_, plan),) = _AUTO_CACHE.values()
    assert plan.checkpoints() > 0 and plan.predicted_peak_bytes <= 250 * 1024

    wrapped = seqckpt.CheckpointedSequential(
        *model, segments="auto", memory_budget="250KiB"
    )
    wrapped(x).sum().backward()
    assert len(_AUTO_CACHE) == 1  # the same modules, input size and budget
    assert AUTO_STATS.profiles == profiles


def test_segments_auto_errors() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="memory_budget"):
        seqckpt.checkpoint_sequential(model, "auto", x)  # CPU: no free-memory figure
    with pytest.raises(ValueError, match="only used with segments='auto'"):
        seqckpt.checkpoint_sequential(model, 2, x, memory_budget="1MiB")
    with pytest.raises(ValueError, match="only used with segments='auto'"):
        seqckpt.CheckpointedSequential(*model, segments=2, memory_budget="1MiB")
    with pytest.raises(TypeError, match="'auto'"):
        seqckpt.checkpoint_sequential(model, "fast", x)


def test_segments_auto_runs_empty_and_meta_batches_plainly_refuses_no_tensor() -> None:
    """An empty batch (a first batch too) runs plainly with nothing profiled:
    a profile at size 0 divided by zero at the next prediction; so does a
    batch on the meta device (it failed measuring memory there). An input
    holding no tensor has no size to plan for: a clear error (it divided by
    zero as well)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    )
    chain = seqckpt.CheckpointedSequential(
        *model, segments="auto", memory_budget="1MiB"
    )
    before = AUTO_STATS.profiles
    for batch in (0, 3, 0):
        x = torch.randn(batch, 8, requires_grad=True)
        assert_matches_plain(
            chain, x, lambda m, t: m(t), plain=lambda m, t: nn.Sequential.forward(m, t)
        )
    assert AUTO_STATS.profiles == before + 1  # the batch of 3 alone
    with torch.device("meta"):  # shapes only: nothing to measure, run plainly
        on_meta = seqckpt.CheckpointedSequential(
            *(nn.Linear(8, 8) for _ in range(3)), segments="auto", memory_budget=1
        )
        x = torch.randn(4, 8, requires_grad=True)
    on_meta(x).sum().backward()
    assert x.grad is not None and x.grad.device.type == "meta"
    assert AUTO_STATS.profiles == before + 1

    class FromIds(nn.Module):
        def forward(self, ids: list[int]) -> torch.Tensor:
            return torch.tensor(ids, dtype=torch.float32)

    with pytest.raises(ValueError, match="^seqckpt: segments='auto' .* no tensor"):
        seqckpt.checkpoint_sequential(
            [FromIds(), *model], "auto", [1, 2], memory_budget="1MiB"
        )


@pytest.mark.cuda
def test_segments_auto_uses_free_cuda_memory() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).cuda()
    x = torch.randn(32, 64, device="cuda")
    _AUTO_CACHE.clear()
    seqckpt.checkpoint_sequential(model, "auto", x).sum().backward()
    ((_, plan),) = _AUTO_CACHE.values()
    assert plan.checkpoints() == 0  # a few KiB fit in any free GPU memory


def test_plan_for_a_budget_example_runs() -> None:
    import runpy
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "plan_for_a_budget.py"
    runpy.run_path(str(path), run_name="__main__")  # asserts inside


def callables_passing_tuples(lins: nn.ModuleList) -> list[Any]:
    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lins[0](x), torch.tanh(x)

    def mix(
        pair: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(lins[1](pair[0])) + pair[1], pair[1]

    def join(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lins[2](pair[0]) * torch.sigmoid(lins[3](pair[1]))

    return [split, mix, mix, join]


def test_plans_chains_of_callables_passing_tuples() -> None:
    torch.manual_seed(0)
    lins = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
    x = torch.randn(64, 32, requires_grad=True)
    chain = callables_passing_tuples(lins)
    top = seqckpt.plan(chain, x).predicted_peak_bytes
    plan = seqckpt.plan(chain, x, int(top * 0.7))
    assert plan.checkpoints() > 0

    def plain(m: nn.Module, t: torch.Tensor) -> Any:
        for f in callables_passing_tuples(m):  # type: ignore[arg-type]
            t = f(t)
        return t

    assert_matches_plain(
        lins,
        x,
        lambda m, t: seqckpt.checkpoint_sequential(
            callables_passing_tuples(m), plan, t
        ),  # type: ignore[arg-type]
        plain=plain,
    )


def flat_resnet_like() -> nn.Sequential:
    """torchvision's ResNet flattened into a chain: conv, bn, an in-place ReLU
    at top level, pooling, stages."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def starts(plan: Plan) -> list[int]:
    found = []
    for item in plan.items:
        if isinstance(item, Recompute):
            found += [item.start, *starts(item.inner)]
    return found


def test_planner_on_a_chain_with_an_in_place_item() -> None:
    model = flat_resnet_like()
    x = torch.randn(4, 3, 16, 16, requires_grad=True)
    prof = seqckpt.profile(model, x, repeats=1)
    assert [p.modifies_input for p in prof.layers] == [
        False, False, True, False, False, False, False, False, False,
    ]  # fmt: skip
    floor = seqckpt.plan(model, x, profile=prof)
    budgets = [int(floor.predicted_peak_bytes * f) for f in (0.3, 0.5, 0.8)]
    for budget in budgets:
        try:
            planned = seqckpt.plan(model, x, budget, profile=prof)
        except PlanError:
            continue
        assert 2 not in starts(planned)  # never recompute from the ReLU's input
        assert_matches_plain(
            model, x, lambda m, t: seqckpt.checkpoint_sequential(m, planned, t)
        )
    _AUTO_CACHE.clear()
    assert_matches_plain(
        model,
        x,
        lambda m, t: seqckpt.checkpoint_sequential(
            m, "auto", t, memory_budget=budgets[-1]
        ),
    )


def test_auto_budget_on_cuda_leaves_room_for_gradients_and_optimizer_state() -> None:
    from seqckpt.planner.planning import available_bytes

    layers = [nn.Linear(100, 100) for _ in range(3)]  # 40,400 bytes each
    params = 3 * 40_400
    free = 10_000_000
    # First step: no gradients yet, no optimizer state yet.
    assert available_bytes(layers, free, 0) == int(0.9 * free) - params - 2 * params
    # Later steps: gradients set to None by zero_grad, optimizer state exists.
    layers[0].weight.grad = torch.zeros_like(layers[0].weight)
    assert available_bytes(layers, free, 0) == int(0.9 * free) - (params - 40_000)
    frozen = nn.Linear(100, 100).requires_grad_(False)
    assert available_bytes([frozen], free, 500) == int(0.9 * (free + 500))
    with pytest.raises(PlanError, match="not enough for this chain's gradients"):
        available_bytes(layers, 10_000, 0)


def test_plans_with_policies_predict_their_peak() -> None:
    """On the GPT-style chain, profiled with compute_heavy as a candidate: the
    measured peak of each plan is within 5% of its prediction (whether the
    policy is chosen depends on measured times; test_solver.py tests the
    choice itself), and plans with policies round-trip through JSON."""
    from seqckpt.executor import run_plan
    from seqckpt.planner.frontier import measure_peak

    spec = MODELS["gpt"]
    model, x = spec.build(), spec.sample("cpu", 4).requires_grad_()
    prof = seqckpt.profile(model, x, repeats=2, policies=(None, "compute_heavy"))
    assert [str(p) for p in prof.policies] == ["compute_heavy"]
    top = seqckpt.plan(model, x, None, profile=prof).predicted_peak_bytes
    for share in (0.8, 0.6, 0.4):
        plan = seqckpt.plan(model, x, int(top * share), profile=prof)
        peak = measure_peak(model, x, lambda m, t: run_plan(plan, list(m), t), "cpu")
        assert abs(peak - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes
        assert peak <= 1.01 * plan.predicted_peak_bytes  # type: ignore[operator]
        assert plan == Plan.from_json(plan.to_json())
    no_policy = seqckpt.plan(model, x, int(top * 0.6), profile=prof, policies=[None])
    assert all(i.policy is None for i in no_policy.items if isinstance(i, Recompute))


def test_an_output_a_policy_keeps_is_held_through_the_recompute() -> None:
    # Blocks ending in a convolution, whose output compute_heavy keeps: the
    # recompute never makes it again (served, or stopped before it), so the
    # kept copy lives through the recompute beside what it makes. The model
    # left it out: a nested stretch under the policy, at the chain's largest
    # activations, measured 1.08x its prediction (segments="auto" ran a step
    # at 1.17x its budget on such a chain).
    from seqckpt.executor import run_plan
    from seqckpt.planner.frontier import measure_peak
    from tests.test_adaptive import strided_chain

    model = strided_chain((3, 8, 16, 32, 64))
    x = torch.randn(2, 3, 64, 64)
    prof = seqckpt.profile(model, x, repeats=1, policies=("compute_heavy",))
    heavy = as_policy("compute_heavy")
    flat = Recompute(0, 1, Plan((Run(0, 1),)), heavy)
    for items in (
        (flat, Run(1, 4)),
        (Recompute(0, 2, Plan((flat, Run(1, 2)))), Run(2, 4)),
    ):
        plan = Plan(items)
        predicted, _ = plan_cost(plan, prof)
        peak = measure_peak(model, x, lambda m, t: run_plan(plan, list(m), t), "cpu")
        assert 0.97 * predicted <= peak <= 1.001 * predicted, (
            str(plan),
            peak / predicted,
        )


def random_items(
    rng: random.Random, start: int, stop: int, depth: int, can_start: list[bool]
) -> list[Any]:
    """Random plan items for layers start..stop-1: runs, recomputes (nested one
    level), stretches under compute_heavy."""
    heavy = as_policy("compute_heavy")
    items: list[Any] = []
    i = start
    while i < stop:
        j = rng.randint(i + 1, stop)
        if rng.random() < 0.5 and can_start[i] and j - i < len(can_start):
            if rng.random() < 0.4:
                items.append(Recompute(i, j, Plan((Run(i, j),)), heavy))
            elif depth == 0:
                inner = random_items(rng, i, j, 1, can_start)
                items.append(Recompute(i, j, Plan(tuple(inner))))
            else:
                items.append(Recompute(i, j, Plan((Run(i, j),))))
        else:
            items.append(Run(i, j))
        i = j
    return items


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_random_plans_peak_as_predicted(name: str) -> None:
    """Whatever the plan (nested, flat, with policies), the measured peak is
    never above the prediction by more than 0.1% nor below it by more than 5%.
    (The buffer copies a region keeps stay through its recompute and inner
    plan: charged only until the recompute, random plans of the resnet ran
    up to 0.7% above.)"""
    from seqckpt.executor import run_plan
    from seqckpt.planner.cost import CostModel
    from seqckpt.planner.frontier import measure_peak

    spec = MODELS[name]
    model, x = spec.build(), spec.sample("cpu", 2).requires_grad_()
    prof = seqckpt.profile(model, x, repeats=1, policies=("compute_heavy",))
    can_start = CostModel.of(prof).can_start
    rng = random.Random(0)
    for _ in range(8):
        plan = Plan(tuple(random_items(rng, 0, len(model), 0, can_start)))
        predicted, _ = plan_cost(plan, prof)
        peak = measure_peak(model, x, lambda m, t: run_plan(plan, list(m), t), "cpu")
        assert 0.95 * predicted <= peak <= 1.001 * predicted, (
            str(plan),
            peak,
            predicted,
        )


def assert_top_and_middle_plans_hold(
    model: nn.Sequential, x: torch.Tensor, prof: seqckpt.planner.ChainProfile
) -> None:
    """Keeping everything, and the plan for the budget halfway down to the
    least peak, measure within 3% below and 1% above their predictions."""
    from seqckpt.planner.frontier import measure_peak
    from seqckpt.planner.solver import smallest_peak

    def step(m: nn.Module, t: torch.Tensor, plan: Plan) -> torch.Tensor:
        torch.manual_seed(1)  # (dropout)
        return seqckpt.checkpoint_sequential(m, plan, t)

    top = seqckpt.plan(model, x, None, profile=prof)
    assert top.predicted_peak_bytes is not None
    least, _ = smallest_peak(prof)
    middle = seqckpt.plan(
        model, x, (least + top.predicted_peak_bytes) // 2, profile=prof
    )
    assert middle.checkpoints() > 0
    for plan in (top, middle):
        measured = measure_peak(model, x, partial(step, plan=plan), "cpu")
        assert plan.predicted_peak_bytes is not None
        assert 0.97 <= measured / plan.predicted_peak_bytes <= 1.01, str(plan)


def test_an_output_no_layer_holds_is_charged_only_through_its_consumer() -> None:
    # A linear layer's output before a ReLU or dropout is held by neither (the
    # ReLU saves its result, dropout its mask), nor is a frozen layer's: it
    # lives through the next layer's forward only. The model charged it until
    # backward (the keep-everything peak of such a chain predicted 1.39x the
    # measured one, a frozen mobilenet_v2 prefix 1.17x).

    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            m
            for act in (nn.ReLU, nn.Dropout, nn.ReLU, nn.Tanh, nn.ReLU)
            for m in (nn.Linear(128, 128), act())
        ]
    )
    for p in model[0].parameters():
        p.requires_grad_(False)  # a frozen first layer
    x = torch.randn(32, 128)
    prof = seqckpt.profile(model, x, repeats=1)
    assert not prof.layers[0].output_held and not prof.layers[1].input_held
    assert prof.layers[3].output_held is False and prof.layers[4].input_held

    assert_top_and_middle_plans_hold(model, x, prof)


def test_an_output_handed_on_by_a_view_or_in_place_passes_through() -> None:
    # A layer that returns its input's storage without holding it (a view;
    # an in-place ReLU where no graph is built: a frozen stem, as torchvision's
    # detection backbones freeze theirs) hands the storage on: it lives until
    # the layer after it, and no longer if that one does not hold it either.
    # The model charged it until backward (predicted 1.21x the measured
    # keep-everything peak of this chain, 1.12x the middle plan's; a resnet50
    # trunk with a frozen stem and layer1, 64x64: 1.03x).

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(128, 256),
        nn.ReLU(inplace=True),
        nn.Dropout(),
        nn.Linear(256, 256),
        nn.Unflatten(1, (16, 16)),
        nn.Flatten(1),
        nn.Dropout(),
        nn.Linear(256, 256),
        nn.Tanh(),
        nn.Linear(256, 128),
    )
    for p in model[0].parameters():
        p.requires_grad_(False)  # a frozen first layer
    x = torch.randn(64, 128)
    prof = seqckpt.profile(model, x, repeats=1)
    assert prof.layers[1].returns_input and prof.layers[4].returns_input

    assert_top_and_middle_plans_hold(model, x, prof)


def test_a_block_repeated_in_the_chain_holds_its_predicted_peaks() -> None:
    # One block applied several times (ALBERT, looped transformers): autograd
    # sums its parameters' gradients over the uses before accumulating them,
    # holding the sum from the last use's backward to the first's, and adds
    # out of place. The model saw each use's gradient as a passing
    # temporary: plans of this chain ran at 2.0x-2.9x their predicted peak.
    from seqckpt.executor import run_plan
    from seqckpt.planner.cost import CostModel
    from seqckpt.planner.frontier import measure_peak
    from seqckpt.planner.profile import shared_grad_bytes

    torch.manual_seed(0)
    block = nn.Sequential(
        nn.LayerNorm(256), nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)
    )
    chain = nn.Sequential(*[block] * 6)
    x = torch.randn(16, 256, requires_grad=True)
    prof = seqckpt.profile(chain, x, repeats=1, policies=("compute_heavy",))
    params = list(block.parameters())
    shared = [layer.shared_grad_bytes for layer in prof.layers]
    assert shared == shared_grad_bytes([params] * 6)
    largest = max(p.nbytes for p in params)
    assert shared[:-1] == [sum(p.nbytes for p in params) + largest] * 5
    assert not shared[-1]
    top = seqckpt.plan(chain, x, None, profile=prof)
    assert top.predicted_peak_bytes is not None
    can_start = CostModel.of(prof).can_start
    rng = random.Random(0)
    plans = [
        top,
        seqckpt.plan(chain, x, int(0.9 * top.predicted_peak_bytes), profile=prof),
    ]
    plans += [
        Plan(tuple(random_items(rng, 0, len(chain), 0, can_start))) for _ in range(3)
    ]
    for plan in plans:
        predicted, _ = plan_cost(plan, prof)
        peak = measure_peak(chain, x, lambda m, t: run_plan(plan, list(m), t), "cpu")
        assert 0.9 * predicted <= peak <= predicted, (str(plan), peak, predicted)
    assert_matches_plain(
        chain, x, lambda m, t: seqckpt.checkpoint_sequential(m, plans[1], t)
    )


def test_plans_under_autocast_hold_their_predicted_peaks() -> None:
    # Under autocast each weight is cast inside the step. The profile must not
    # find the casts of its own earlier runs in autocast's cache (it predicted
    # the keep-everything peak at a third of the measured one, torchvision's
    # mobilenet_v2's 18% low); and with the cache on (the default) the copy of
    # every weight a recomputed stretch casts stays in the cache until the
    # autocast block ends, though the region drops what it saved, so plans
    # must count it (on this chain, where the copies dominate, plans measured
    # 1.3x-2.0x their predicted peak when they did not). The block ends before
    # backward: counted until the recompute instead, the smallest feasible
    # budget was a third above the least peak a plan measures (0.98x the
    # keep-everything peak here).
    from seqckpt.planner.frontier import measure_peak
    from seqckpt.planner.solver import smallest_peak

    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)]
    )
    x = torch.randn(4, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prof = seqckpt.profile(model, x, repeats=1)
    weights = 2 * (256 * 256 + 256)  # bf16 copies of a Linear's weight and bias
    assert [layer.region_cast_bytes for layer in prof.layers] == [weights] * 6
    top = seqckpt.plan(model, x, None, profile=prof)
    assert top.predicted_peak_bytes is not None
    least, _ = smallest_peak(prof)
    assert least < 0.85 * top.predicted_peak_bytes

    def step(m: nn.Module, t: torch.Tensor, plan: Plan) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return seqckpt.checkpoint_sequential(m, plan, t).float()

    for share in (0.0, 0.5, 1.0):
        budget = int(least + (top.predicted_peak_bytes - least) * share)
        plan = seqckpt.plan(model, x, budget, profile=prof)
        assert (plan.checkpoints() > 0) == (share < 1.0)
        measured = measure_peak(model, x, partial(step, plan=plan), "cpu")
        # (backward runs after the autocast block, which empties the cache:
        # the profile measures each item's backward so)
        ratio = measured / plan.predicted_peak_bytes
        assert 0.97 <= ratio <= 1.01, (share, ratio, str(plan))


def test_the_chains_output_is_held_by_its_caller_through_backward() -> None:
    # The caller holds the chain's output until backward ends. The last item's
    # backward was measured with that output freed once its saver (the final
    # ReLU) let it go, and a recomputed last stretch makes a copy of it beside
    # the caller's while its gradient is live: this chain ran 1.07x its
    # keep-everything prediction and 1.29x with the last stretch recomputed.
    from seqckpt.planner.frontier import measure_peak

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.Tanh(),
        nn.Linear(256, 256),
        nn.Sequential(nn.Linear(256, 1024), nn.ReLU()),
    )
    x = torch.randn(256, 64, requires_grad=True)
    prof = seqckpt.profile(model, x, repeats=1)
    keep_all = Plan((Run(0, 4),))
    tail = Plan((Run(0, 2), Recompute(2, 4, Plan((Run(2, 4),)))))
    whole = Plan((Recompute(0, 4, Plan((Run(0, 4),))),))
    for plan, low in ((keep_all, 0.999), (tail, 0.9), (whole, 0.9)):
        predicted, _ = plan_cost(plan, prof)
        measured = measure_peak(
            model, x, lambda m, t, p=plan: seqckpt.checkpoint_sequential(m, p, t), "cpu"
        )
        # a recomputed copy of the output is freed mid-backward, which the
        # profile does not time: counted throughout, on the safe side
        assert low <= measured / predicted <= 1.001, (str(plan), measured / predicted)
