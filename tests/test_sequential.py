"""checkpoint_sequential and CheckpointedSequential: parity, segment forms, errors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import seqckpt
from seqckpt import CheckpointedSequential, checkpoint_sequential
from seqckpt.planner import Plan, PlanError, Recompute, Run
from seqckpt.planner.tree import plan_from_sizes
from tests.oracle import assert_matches_plain


def chain(n: int = 7, width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            layers.append(nn.Linear(width, width))
        elif kind == 1:
            layers.append(nn.Dropout(0.3))
        elif kind == 2:
            layers.append(nn.BatchNorm1d(width))
        else:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x).tanh()


@pytest.mark.parametrize("k", range(1, 8))
def test_parity_every_segment_count(k: int) -> None:
    x = torch.randn(5, 6, requires_grad=True)
    assert_matches_plain(chain(), x, lambda m, x: checkpoint_sequential(m, k, x))


@pytest.mark.parametrize("form", ["sequential", "modulelist", "list", "tuple"])
def test_parity_every_form_of_modules(form: str) -> None:
    def call(m: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        items = {
            "sequential": m,
            "modulelist": nn.ModuleList(m),
            "list": list(m),
            "tuple": tuple(m),
        }[form]
        return checkpoint_sequential(items, 3, x)

    assert_matches_plain(chain(), torch.randn(5, 6, requires_grad=True), call)


def test_plain_callables_and_nested_sequentials() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
    items = [model[0], torch.tanh, model[1], lambda t: t * 2]
    x = torch.randn(3, 4, requires_grad=True)
    assert_matches_plain(
        model,
        x,
        lambda m, x: checkpoint_sequential(
            [m[0], torch.tanh, m[1], lambda t: t * 2], 2, x
        ),
        plain=lambda m, x: m[1](torch.tanh(m[0](x))) * 2,
    )
    assert len(items) == 4


def test_balanced_sizes_and_which_segments_recompute() -> None:
    layers = [Counting() for _ in range(10)]
    x = torch.randn(2, 4, requires_grad=True)
    checkpoint_sequential(layers, 4, x).sum().backward()
    # sizes 2, 2, 3, 3: the first 7 layers recompute, the last 3 run once
    assert [m.calls for m in layers] == [2] * 7 + [1] * 3


def test_sizes_list_and_plan() -> None:
    layers = [Counting() for _ in range(5)]
    x = torch.randn(2, 4, requires_grad=True)
    checkpoint_sequential(layers, [1, 3, 1], x).sum().backward()
    assert [m.calls for m in layers] == [2, 2, 2, 2, 1]
    for m in layers:
        m.calls = 0
    nested = Plan(
        (
            Run(0, 1),
            Recompute(0 + 1, 4, Plan((Recompute(1, 2, Plan((Run(1, 2),))), Run(2, 4)))),
            Run(4, 5),
        )
    )
    checkpoint_sequential(layers, nested, x).sum().backward()
    # layer 1 runs in forward, in the outer recompute and in its own recompute
    assert [m.calls for m in layers] == [1, 3, 2, 2, 1]


def test_nested_plan_parity() -> None:
    nested = Plan(
        (
            Recompute(0, 5, Plan((Recompute(0, 2, Plan((Run(0, 2),))), Run(2, 5)))),
            Run(5, 7),
        )
    )
    x = torch.randn(5, 6, requires_grad=True)
    assert_matches_plain(chain(), x, lambda m, x: checkpoint_sequential(m, nested, x))


def test_tuples_and_dicts_between_stages() -> None:
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x).relu(), self.b(x)

    class ToDict(nn.Module):
        def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> dict:
            return {"h": xy[0] * xy[1], "skip": xy[1]}

    class Merge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, d: dict) -> torch.Tensor:
            return self.lin(d["h"]) + d["skip"]

    torch.manual_seed(0)
    model = nn.Sequential(Split(), ToDict(), Merge(), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    for k in (1, 2, 3, 4):
        assert_matches_plain(model, x, lambda m, x: checkpoint_sequential(m, k, x))


def test_no_grad_runs_plainly() -> None:
    layers = [Counting() for _ in range(3)]
    with torch.no_grad():
        y = checkpoint_sequential(layers, 2, torch.randn(2, 4))
    assert y.grad_fn is None and [m.calls for m in layers] == [1, 1, 1]


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("segments", "error", "pattern"),
    [
        (0, ValueError, r"segments.*between 1 and .*\(4\).*segments=0"),
        (-2, ValueError, r"segments.*\(4\).*segments=-2"),
        (5, ValueError, r"segments.*\(4\).*segments=5"),
        ([2, 1], ValueError, r"segments.*sum to .*\(4\).*\[2, 1\]"),
        ([2, 0, 2], ValueError, r"segments.*positive.*\[2, 0, 2\]"),
        (2.0, TypeError, r"segments.*2\.0.*float"),
        (True, TypeError, r"segments.*True.*bool"),
        ("two", TypeError, r"segments.*'two'"),
        ([1.5, 2.5], TypeError, r"segments.*\[1\.5, 2\.5\]"),
    ],
)
def test_bad_segments(segments: object, error: type, pattern: str) -> None:
    layers = [nn.Linear(2, 2) for _ in range(4)]
    with pytest.raises(error, match="^seqckpt: " + pattern):
        checkpoint_sequential(layers, segments, torch.randn(1, 2))  # type: ignore[arg-type]


def test_plan_for_another_chain_is_rejected() -> None:
    plan = Plan((Run(0, 3),))
    with pytest.raises(PlanError, match=r"^seqckpt: segments=plan.*4 modules"):
        checkpoint_sequential([nn.Linear(2, 2)] * 4, plan, torch.randn(1, 2))


def test_bad_chains() -> None:
    with pytest.raises(ValueError, match="^seqckpt: .*empty chain"):
        checkpoint_sequential([], 1, torch.randn(1))
    with pytest.raises(TypeError, match=r"^seqckpt: functions\[1\] is not callable: 3"):
        checkpoint_sequential([nn.Identity(), 3], 1, torch.randn(1))
    with pytest.raises(TypeError, match="^seqckpt: argument 'functions'.*dict"):
        checkpoint_sequential({"a": nn.Identity()}, 1, torch.randn(1))  # type: ignore[arg-type]


# --------------------------------------------------- CheckpointedSequential


def test_checkpointed_sequential_parity_and_buffers() -> None:
    x = torch.randn(5, 6, requires_grad=True)
    assert_matches_plain(
        chain(), x, lambda m, x: CheckpointedSequential.from_sequential(m, 3)(x)
    )


def test_checkpointed_sequential_is_a_drop_in() -> None:
    plain = chain()
    ckpt = CheckpointedSequential.from_sequential(plain, segments=[3, 4])
    assert all(a is b for a, b in zip(ckpt, plain, strict=False))
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    fresh = CheckpointedSequential(*chain(), segments=2)
    fresh.load_state_dict(plain.state_dict())
    named = CheckpointedSequential(
        OrderedDict([("inp", nn.Linear(6, 6)), ("act", nn.ReLU())]), segments=1
    )
    assert list(named.state_dict()) == ["inp.weight", "inp.bias"]
    assert isinstance(ckpt[0], nn.Linear) and len(ckpt) == 7
    assert isinstance(ckpt[1:3], CheckpointedSequential) and len(ckpt[1:3]) == 2
    ckpt.append(nn.Tanh())
    assert len(ckpt) == 8 and isinstance(ckpt[-1], nn.Tanh)
    ckpt.segments = 4
    ckpt(torch.randn(5, 6)).sum().backward()


def test_slices_sums_and_products_keep_the_configuration() -> None:
    ckpt = CheckpointedSequential.from_sequential(
        chain(6), segments=3, determinism_check="values", policy="compute_heavy"
    )
    ckpt.eval()
    parts = {
        "slice": ckpt[1:3],
        "sum": ckpt + nn.Sequential(nn.Tanh()),
        "product": ckpt * 2,
        "reversed product": 2 * ckpt,
    }
    for what, part in parts.items():
        assert type(part) is CheckpointedSequential, what
        assert part.options == ckpt.options and part.policy == ckpt.policy, what
        assert part.segments == min(3, len(part)) and not part.training, what
    assert [len(p) for p in parts.values()] == [2, 7, 12, 12]
    assert all(a is b for a, b in zip(ckpt[1:3], list(ckpt)[1:3], strict=True))
    # Sizes fit only the whole chain: a part falls back to the default; "auto" stays.
    assert CheckpointedSequential(*chain(6), segments=[2, 4])[:3].segments is None
    assert CheckpointedSequential(*chain(6), segments="auto")[:3].segments == "auto"
    head = CheckpointedSequential(*chain(6), segments=2)[:4]
    x = torch.randn(5, 6, requires_grad=True)
    assert_matches_plain(
        head, x, lambda m, x: m(x), plain=lambda m, x: nn.Sequential.forward(m, x)
    )


def test_a_chain_changed_in_place_keeps_its_segments_where_they_fit() -> None:
    x = torch.randn(5, 6, requires_grad=True)
    shrunk = CheckpointedSequential(*chain(6), segments=6)
    del shrunk[0]
    shrunk.pop(0)  # a count is capped at the new length, as for a slice
    assert_matches_plain(
        shrunk, x, lambda m, x: m(x), plain=lambda m, x: nn.Sequential.forward(m, x)
    )
    for given in ([3, 2, 1], plan_from_sizes([3, 2, 1])):
        grown = CheckpointedSequential(*chain(6), segments=given)
        grown.append(nn.Tanh())
        with pytest.raises(
            ValueError, match=r"^seqckpt: .* has 7 modules now, .* cover 6: .*append"
        ):
            grown(x)
        grown.segments = [4, 3]
        assert_matches_plain(
            grown, x, lambda m, x: m(x), plain=lambda m, x: nn.Sequential.forward(m, x)
        )


def test_checkpointed_sequential_eval_and_no_grad_are_plain() -> None:
    layers = [Counting() for _ in range(4)]
    model = CheckpointedSequential(*layers, segments=2)
    model(torch.randn(2, 4)).sum().backward()
    assert [m.calls for m in layers] == [2, 2, 1, 1]
    seen: list[bool] = []
    model.append(nn.Identity())
    model[-1].register_forward_hook(lambda *a: seen.append(seqckpt.is_checkpointing()))
    model.eval()
    model(torch.randn(2, 4))
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert seen == [False, False]


def test_checkpointed_sequential_errors() -> None:
    with pytest.raises(ValueError, match=r"^seqckpt: segments.*\(2\).*segments=3"):
        CheckpointedSequential(nn.Linear(2, 2), nn.ReLU(), segments=3)
    with pytest.raises(TypeError, match="^seqckpt: from_sequential"):
        CheckpointedSequential.from_sequential([nn.Linear(2, 2)])  # type: ignore[arg-type]


def test_a_step_leaves_no_reference_cycles() -> None:
    """Cyclic garbage would keep region inputs alive until the garbage collector
    runs, so activations would outlive their backward (a nested plan used to
    hold each nested region's input this way)."""
    import gc

    model = chain(9)
    plan = Plan(
        (
            Recompute(0, 4, Plan((Recompute(0, 2, Plan((Run(0, 2),))), Run(2, 4)))),
            Recompute(4, 7, Plan((Run(4, 5), Recompute(5, 7, Plan((Run(5, 7),)))))),
            Run(7, 9),
        )
    )
    x = ({"a": torch.randn(5, 6, requires_grad=True)},)

    def step() -> None:
        checkpoint_sequential(
            [lambda t: t[0]["a"], *list(model)[1:]], plan, x
        ).sum().backward()

    # Collect until nothing is left: what earlier tests left behind (compiled
    # graphs) comes free over several rounds of finalizers.
    step()
    for _ in range(10):
        if gc.collect() == 0:
            break
    gc.disable()
    try:
        step()
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_default_segments_checkpoint_short_chains() -> None:
    # Every stage of resnet18 holds two blocks: the default must recompute one.
    blocks = [Counting(), Counting()]
    model = CheckpointedSequential(*blocks)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert [b.calls for b in blocks] == [2, 1]
    single = CheckpointedSequential(Counting())
    with pytest.warns(UserWarning, match="single module checkpoints nothing"):
        single(torch.randn(3, 4, requires_grad=True)).sum().backward()


def test_int_segments_never_start_at_an_in_place_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(inplace=True),
        nn.Linear(6, 6),
        nn.ReLU(inplace=True),
        nn.Linear(6, 6),
    )
    x = torch.randn(5, 6, requires_grad=True)
    for k in range(1, len(model) + 1):
        assert_matches_plain(model, x, lambda m, t: checkpoint_sequential(m, k, t))
    plan = seqckpt.executor.resolve_plan(3, list(model))
    assert [i.start for i in plan.items if isinstance(i, Recompute)] == [0, 3]


def test_the_quickstart_example() -> None:
    # the README's first example, as examples/quickstart.py runs it
    import runpy
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "quickstart.py"
    assert runpy.run_path(str(path))["same"] is True
