"""Tests of the recompute primitive, one block per promise in its docstring."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import gc
import threading
import types
import warnings
import weakref
from collections import namedtuple
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

import seqckpt
from seqckpt import CheckpointError, checkpoint
from tests.counting import CountsFinished, SavesLessTheSecondTime
from tests.oracle import assert_matches_plain
from tests.test_robustness import NoiseOfItsOwn


def mlp(dropout: float = 0.3, bn: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.Dropout(dropout), nn.GELU()]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers.append(nn.Linear(16, 4))
    return nn.Sequential(*layers)


class Counting(nn.Module):
    """Counts its calls, so tests can prove a recompute happened."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("bn", [False, True])
def test_parity_with_plain_run(dropout: float, bn: bool) -> None:
    x = torch.randn(6, 8, requires_grad=True)
    assert_matches_plain(mlp(dropout, bn), x, lambda m, x: checkpoint(m, x))


def test_parity_when_input_needs_no_grad() -> None:
    x = torch.randn(6, 8)
    assert_matches_plain(mlp(), x, lambda m, x: checkpoint(m, x))


def test_recompute_happens_once_per_backward() -> None:
    block = Counting(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    y = checkpoint(block, torch.randn(2, 4, requires_grad=True))
    assert block.calls == 1
    y.sum().backward()
    assert block.calls == 2


def test_no_recompute_when_only_inputs_and_parameters_are_saved() -> None:
    # A linear layer saves its input and (a view of) its weight: both are alive
    # anyway, so the region holds them and backward needs no recompute.
    block = Counting(nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(block, x)
    y.sum().backward()
    assert block.calls == 1
    ref = nn.Linear(4, 4)
    ref.load_state_dict(block.inner.state_dict())
    x2 = x.detach().requires_grad_()
    ref(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(block.inner.weight.grad, ref.weight.grad)
    # ...and an input changed in place before backward is still caught.
    h = x * 1
    y = checkpoint(block, h)
    h.mul_(2)
    with pytest.raises(CheckpointError, match="modified in place"):
        y.sum().backward()


def test_keeps_no_activation_of_the_function() -> None:
    """The tensors autograd saves inside are not held after forward."""
    alive: list[weakref.ref[torch.Tensor]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()  # exp saves its output
        alive.append(weakref.ref(h))
        return (h * 2).sin()

    y = checkpoint(f, torch.randn(3, requires_grad=True))
    assert alive[0]() is None
    y.sum().backward()


# ------------------------------------------------------- autograd surface


def test_autograd_grad_writes_no_grad_fields() -> None:
    model, reference = mlp(), mlp()
    x = torch.randn(6, 8, requires_grad=True)
    torch.manual_seed(1)
    (got,) = torch.autograd.grad(checkpoint(model, x).sum(), x)
    assert x.grad is None
    assert all(p.grad is None for p in model.parameters())
    torch.manual_seed(1)
    (ref,) = torch.autograd.grad(reference(x).sum(), x)
    assert torch.equal(got, ref)


def test_backward_inputs_only_fills_requested() -> None:
    model = mlp(dropout=0.0)
    x = torch.randn(6, 8, requires_grad=True)
    checkpoint(model, x).sum().backward(inputs=[model[0].weight])
    assert x.grad is None
    assert model[0].weight.grad is not None
    assert model[-1].weight.grad is None


def test_parameters_get_grads_without_input_grad() -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    checkpoint(lambda t: model(t).tanh(), x).sum().backward()
    assert model.weight.grad is not None
    ref = nn.Linear(4, 4)
    ref.load_state_dict(model.state_dict())
    ref(x).tanh().sum().backward()
    assert torch.equal(model.weight.grad, ref.weight.grad)


def test_detached_and_no_grad_inside() -> None:
    w = nn.Parameter(torch.randn(4))

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            scale = x.abs().max()
        d = x.detach() * 3
        return (x * w).sin() * scale + d, d

    x = torch.randn(4, requires_grad=True)
    y, d = checkpoint(f, x)
    assert not d.requires_grad
    y.sum().backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    y, _ = f(x)
    y.sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


Pair = namedtuple("Pair", "a b")


def test_kwargs_containers_and_non_tensors() -> None:
    lin = nn.Linear(3, 3)

    def f(
        pair: Pair, items: list[torch.Tensor], *, scale: float, table: dict, tag: str
    ) -> dict:
        out = lin(pair.a) * scale + items[0] * table["w"]
        return {"out": out, "both": (out, pair.b * 2), "tag": tag, "n": 3, "none": None}

    def inputs() -> tuple:
        torch.manual_seed(3)
        a = torch.randn(2, 3, requires_grad=True)
        b = torch.randn(2, 3, requires_grad=True)
        c = torch.randn(2, 3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        return a, b, c, w

    results = []
    for use in (False, True):
        a, b, c, w = inputs()
        lin.zero_grad(set_to_none=True)
        call = (lambda *a, **k: checkpoint(f, *a, **k)) if use else f
        out = call(Pair(a, b), [c], scale=0.5, table={"w": w}, tag="x")
        assert out["tag"] == "x" and out["n"] == 3 and out["none"] is None
        (out["out"].sum() + out["both"][1].sum()).backward()
        results.append([a.grad, b.grad, c.grad, w.grad, lin.weight.grad])
    for got, ref in zip(results[1], results[0], strict=False):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("nested", [False, True])
def test_lists_and_dicts_changed_after_the_call(nested: bool) -> None:
    # DenseNet hands each layer the list of all earlier features and appends
    # the layer's output to it afterwards; the recompute read the longer list
    # (a shape error in backward, torch's checkpoint alike). A list the
    # function appends to (outputs collected layer by layer) got every entry
    # twice, the second in backward.
    def dense(
        lin: nn.Module, x: torch.Tensor, call: Callable[..., Any]
    ) -> torch.Tensor:
        def layer(features: list, table: dict, collected: list) -> torch.Tensor:
            out = torch.tanh(lin(torch.cat(features)) * table["scale"])
            collected.append(out.detach())
            return out

        features, table, collected = [x], {"scale": 2.0}, []
        for _ in range(3):
            features.append(call(layer, features, table, collected))
            table["scale"] = 0.5  # changed too
        assert len(collected) == 3
        return torch.cat(features).sum()

    def checkpointed(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if nested:
            return checkpoint(dense, lin, x, checkpoint)  # type: ignore[no-any-return]
        return dense(lin, x, checkpoint)

    x = torch.randn(2, 3, requires_grad=True)
    assert_matches_plain(
        nn.Linear(3, 3), x, checkpointed, lambda m, t: dense(m, t, lambda f, *a: f(*a))
    )

    def collecting(t: torch.Tensor, out: list[torch.Tensor]) -> torch.Tensor:
        out.append(t.detach())
        return t.exp()

    collected: list[torch.Tensor] = []
    checkpoint(collecting, x, collected).sum().backward()
    assert len(collected) == 1  # the recompute appended to a copy


class NamedTable(dict):  # type: ignore[type-arg]
    """A dict subclass whose constructor takes something else than items."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


@pytest.mark.parametrize("kind", ["defaultdict", "OrderedDict", "NamedTable"])
def test_dict_subclass_inputs_of_a_nested_region(kind: str) -> None:
    # A region nested in another saves its inputs through the outer one and
    # rebuilds its arguments from them in backward: a dict subclass must come
    # back as itself (defaultdict(items) took the items for a default factory).
    def table(t: torch.Tensor) -> dict:  # type: ignore[type-arg]
        made: dict = {  # type: ignore[type-arg]
            "defaultdict": lambda: collections.defaultdict(list),
            "OrderedDict": collections.OrderedDict,
            "NamedTable": lambda: NamedTable("t"),
        }[kind]()
        made["x"], made["scale"] = t, 2.0
        return made

    def inner(d: dict) -> torch.Tensor:  # type: ignore[type-arg]
        assert type(d) is type(table(torch.ones(1)))
        return d["x"].sin() * d["scale"]

    def outer(t: torch.Tensor) -> torch.Tensor:
        return checkpoint(inner, table(t * 3)).exp()

    x = torch.randn(5, requires_grad=True)
    checkpoint(outer, x).sum().backward()
    got = x.grad
    x.grad = None
    (inner(table(x * 3))).exp().sum().backward()
    assert got is not None and torch.equal(got, x.grad)


def test_nested_checkpoints_match_and_recompute_inner() -> None:
    inner = Counting(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    outer_tail = nn.Linear(8, 8)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.tail = inner, outer_tail

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.tail(checkpoint(self.inner, x)).relu()

    model = Outer()
    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(model, x, lambda m, x: checkpoint(m, x))
    inner.calls = 0
    checkpoint(model, x).sum().backward()
    # forward, outer recompute, inner recompute
    assert inner.calls == 3


def test_a_nested_region_with_buffers_drops_its_inputs() -> None:
    # A nested region saves its inputs through the enclosing region's hooks,
    # which drop them; its buffer guard held on to them (a larger peak).
    head, inner = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    seen: list[weakref.ref[torch.Tensor]] = []

    def outer(x: torch.Tensor) -> torch.Tensor:
        h = head(x)
        seen.append(weakref.ref(h))
        return checkpoint(inner, h).tanh()

    y = checkpoint(outer, torch.randn(4, 8, requires_grad=True))
    assert seen[0]() is None
    y.sum().backward()


def test_trailing_inner_region_is_not_run_by_the_outer_recompute() -> None:
    head = nn.Linear(8, 8)
    inner = Counting(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))

    def outer(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(inner, head(x))

    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(
        nn.ModuleList([head, inner]),
        x,
        lambda m, x: checkpoint(lambda h: checkpoint(m[1], m[0](h)), x),
        plain=lambda m, x: m[1](m[0](x)),
    )
    inner.calls = 0
    checkpoint(outer, x).sum().backward()
    # forward and inner recompute: the outer recompute stops once the inner
    # region's inputs (its last saved tensors) are back, before running it
    assert inner.calls == 2


def test_double_backward() -> None:
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1), nn.Sigmoid())
    x = torch.randn(3, 5, requires_grad=True)

    def hessian_vector(use: bool) -> tuple[torch.Tensor, ...]:
        y = checkpoint(f, x) if use else f(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), [x, f[0].weight])

    for got, ref in zip(hessian_vector(True), hessian_vector(False), strict=False):
        assert torch.equal(got, ref)


def test_retain_graph_allows_second_backward() -> None:
    block = Counting(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(block, x)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    assert torch.equal(x.grad, 2 * first)
    assert block.calls == 3


def test_second_backward_without_retain_graph_raises() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(nn.Linear(4, 4), x).exp().sum()
    y.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


# ------------------------------------------------------------- RNG, autocast


def test_dropout_and_caller_rng() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout()
    )
    x = torch.randn(16, 8, requires_grad=True)
    assert_matches_plain(model, x, lambda m, x: checkpoint(m, x))


@pytest.mark.parametrize("check", ["default", "values"])
@pytest.mark.parametrize("where", ["region", "segment"])
def test_rrelu_ending_a_region(check: str, where: str) -> None:
    # rrelu_with_noise saves its noise tensor before its kernel fills it, so a
    # recompute stopped at that save kept an unfilled tensor: silently wrong
    # gradients (torch's checkpoint too, pytorch#193671), and "values"
    # fingerprinted the unfilled memory in both runs (a false CheckpointError).
    model = nn.Sequential(nn.Linear(64, 64), nn.RReLU(0.1, 0.9))

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if where == "region":
            y = checkpoint(m, x, determinism_check=check)
        else:
            stack = nn.Sequential(*m, nn.Linear(64, 64))  # RReLU ends segment 1
            y = seqckpt.checkpoint_sequential(stack, [2, 1], x, determinism_check=check)
        # memory the recompute's empty noise tensor is likely to reuse
        junk = [torch.full((32, 64), 1e6) for _ in range(16)]
        del junk
        return y

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) if where == "region" else nn.Sequential(*m, nn.Linear(64, 64))(x)

    x = torch.randn(32, 64, requires_grad=True)
    # (the oracle seeds both runs alike: the segment case's extra Linear gets
    # the same weights in each)
    assert_matches_plain(model, x, run, plain=plain)


Call = Callable[[nn.Sequential, torch.Generator, torch.Tensor], torch.Tensor]

# a script's globals, as a notebook holds its model
GLOBAL_NOISE: nn.Module | None = None
GLOBAL_GENERATOR_OF_ITS_OWN: torch.Generator | None = None


def run_through_globals(h: torch.Tensor) -> torch.Tensor:
    assert GLOBAL_NOISE is not None
    return GLOBAL_NOISE(h, GLOBAL_GENERATOR_OF_ITS_OWN)


def checkpoint_through_globals(
    m: nn.Sequential, g: torch.Generator, x: torch.Tensor
) -> torch.Tensor:
    global GLOBAL_NOISE, GLOBAL_GENERATOR_OF_ITS_OWN
    GLOBAL_NOISE, GLOBAL_GENERATOR_OF_ITS_OWN = m[0], g
    return m[2](m[1](checkpoint(run_through_globals, x)))


# How the generator is reached: (checkpointed call, plain call) of the chain
# NoiseOfItsOwn, Linear, NoiseOfItsOwn; ``gen`` is a generator the caller holds.
GENERATOR_CALLS: dict[str, tuple[Call, Call]] = {
    "attribute": (lambda m, g, x: checkpoint(m, x), lambda m, g, x: m(x)),
    "segments": (
        lambda m, g, x: seqckpt.checkpoint_sequential(m, 2, x),
        lambda m, g, x: m(x),
    ),
    "closure": (
        lambda m, g, x: m[2](m[1](checkpoint(lambda h: m[0](h, g), x))),
        lambda m, g, x: m[2](m[1](m[0](x, g))),
    ),
    "default": (  # bound as default arguments, as a loop binds them
        lambda m, g, x: m[2](m[1](checkpoint(lambda h, f=m[0], g=g: f(h, g), x))),
        lambda m, g, x: m[2](m[1](m[0](x, g))),
    ),
    "chain_closure": (  # a chain item that is a plain callable
        lambda m, g, x: seqckpt.checkpoint_sequential(
            [lambda h: m[0](h, g), m[1], m[2]], 2, x
        ),
        lambda m, g, x: m[2](m[1](m[0](x, g))),
    ),
    "global": (  # the walk did not read globals: not replayed
        checkpoint_through_globals,
        lambda m, g, x: m[2](m[1](m[0](x, g))),
    ),
    "argument": (
        lambda m, g, x: m[2](m[1](checkpoint(m[0], x, g))),
        lambda m, g, x: m[2](m[1](m[0](x, g))),
    ),
    "keyword": (
        lambda m, g, x: m[2](m[1](checkpoint(m[0], x, gen=g))),
        lambda m, g, x: m[2](m[1](m[0](x, g))),
    ),
}


@pytest.mark.parametrize("reached", list(GENERATOR_CALLS))
def test_a_generator_of_its_own_is_replayed(reached: str) -> None:
    # Noise drawn from a torch.Generator of the model's own: the recompute must
    # draw what the forward drew (torch's checkpoint draws the next numbers:
    # silently wrong gradients) and leave the generator where the plain run
    # leaves it. Two steps, so a generator advanced twice would show.
    def train(call: Call) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(NoiseOfItsOwn(8), nn.Linear(8, 8), NoiseOfItsOwn(8))
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(4, 8, requires_grad=True)
        out: list[torch.Tensor] = []
        for _ in range(2):
            y = call(model, gen, x)
            y.square().sum().backward()
            out += [y.detach(), *(t.grad for t in (x, *model.parameters()))]
            x.grad = None
            model.zero_grad()
        return [*out, *(g.get_state() for g in (gen, model[0].gen, model[2].gen))]

    checkpointed, plain = GENERATOR_CALLS[reached]
    for i, (a, b) in enumerate(zip(train(checkpointed), train(plain), strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs"


def test_a_module_class_without_a_module_name() -> None:
    # A class made with type() whose __module__ was set to None: the check of
    # which classes may hold a generator must not assume a name.
    made = type("Made", (NoiseOfItsOwn,), {})
    made.__module__ = None  # type: ignore[assignment]
    torch.manual_seed(0)
    assert_matches_plain(made(8), torch.randn(4, 8, requires_grad=True), checkpoint)


def test_without_preserve_rng_state_dropout_differs() -> None:
    """Shows the flag matters: without it, the recompute draws another mask."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    torch.manual_seed(0)
    checkpoint(model, x, preserve_rng_state=False).sum().backward()
    got = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    model(x).sum().backward()
    assert not torch.equal(got, x.grad)


@pytest.mark.parametrize("preserve", [True, False])
def test_values_check_names_preserve_rng_state_when_it_is_off(preserve: bool) -> None:
    # With the flag off the likeliest cause of other values is the region's
    # own dropout; with it on, the error must not blame the flag.
    state = {"calls": 0}

    def drifting(x: torch.Tensor) -> torch.Tensor:
        state["calls"] += 1
        return (x * state["calls"]).exp().sum()

    y = checkpoint(
        drifting,
        torch.randn(4, requires_grad=True),
        preserve_rng_state=preserve,
        determinism_check="values",
    )
    with pytest.raises(CheckpointError, match="other values") as info:
        y.backward()
    assert ("preserve_rng_state=False" in str(info.value)) is not preserve


def step_between_two_backwards(
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> None:
    """Backward, an optimizer step, and backward again through the same graph
    (a GAN's discriminator stepped before the generator's backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    y = run(model, torch.randn(2, 4))
    y.sum().backward(retain_graph=True)
    optimizer.step()
    y.sum().backward()


@pytest.mark.parametrize(
    "run",
    [
        lambda m, x: m(x),
        lambda m, x: checkpoint(m, x),
        lambda m, x: seqckpt.checkpoint_sequential(m, 2, x),
        lambda m, x: checkpoint(lambda t: m[2:](checkpoint(m[:2], t)), x),
    ],
    ids=["plain", "region", "segments", "nested"],
)
def test_a_parameter_stepped_before_backward_raises_as_in_the_plain_run(
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> None:
    # torch's checkpoint recomputes with the stepped weights, no error. The
    # region's own writes in its recompute are not reported
    # (test_a_parameter_changed_in_place_by_the_function_itself_is_fine).
    with pytest.raises(
        RuntimeError,
        match=r"modified by an inplace operation.* is at version 2; expected version 1",
    ):
        step_between_two_backwards(run)


def test_values_check_names_a_stepped_parameter() -> None:
    # the recompute's values differ before any parameter is unpacked
    with pytest.raises(CheckpointError, match="a parameter an optimizer stepped"):
        step_between_two_backwards(
            lambda m, x: checkpoint(m, x, determinism_check="values")
        )


def assert_matches_plain_under_autocast(model: nn.Module, x: torch.Tensor) -> None:
    """The oracle with both runs under bf16 CPU autocast."""

    def under_autocast(m: nn.Module, x: torch.Tensor, use: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return checkpoint(m, x) if use else m(x)

    assert_matches_plain(
        model,
        x,
        lambda m, x: under_autocast(m, x, True),
        plain=lambda m, x: under_autocast(m, x, False),
    )


def test_autocast_replayed_in_recompute() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    assert_matches_plain_under_autocast(model, torch.randn(4, 8, requires_grad=True))


def test_a_weight_used_twice_under_autocast_shares_its_cast() -> None:
    # Under autocast a weight used twice in a region is cast once (autocast's
    # cache), so its gradient is summed in low precision before the cast
    # back, as in the plain run; a region that cast without the cache would
    # cast twice and sum in float32 (diffusers' DiT differed so).
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(torch.tanh(self.shared(x)))

    assert_matches_plain_under_autocast(Twice(), torch.randn(8, 16, requires_grad=True))


def test_default_device_context_replayed() -> None:
    seen: list[torch.device] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_default_device())
        return x * torch.ones(x.shape)

    x = torch.randn(3, device="meta", requires_grad=True)
    with torch.device("meta"):
        y = checkpoint(f, x)
    y.sum().backward()
    assert [d.type for d in seen] == ["meta", "meta"]
    assert x.grad is not None and x.grad.device.type == "meta"


# ------------------------------------------------------------ determinism


class Flip(nn.Module):
    """Computes something else after ``flip`` is set: a recompute that differs."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.flip = mode, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.flip:
            return x.exp().sum(0)
        if self.mode == "shape":
            return x[:1].exp().sum(0)
        if self.mode == "dtype":
            return x.double().exp().float().sum(0)
        if self.mode == "fewer":
            return x.sum(0)
        if self.mode == "more":
            return x.exp().sin().sum(0)
        return (x + 1e-3).exp().sum(0)  # same metadata, other values


@pytest.mark.parametrize(
    ("mode", "match"),
    [("shape", "shape"), ("dtype", "float64"), ("fewer", "saved 0 tensors")],
)
def test_default_check_catches_metadata_changes(mode: str, match: str) -> None:
    f = Flip(mode)
    y = checkpoint(f, torch.randn(3, 2, requires_grad=True))
    f.flip = True
    with pytest.raises(CheckpointError, match=match) as info:
        y.sum().backward()
    assert str(info.value).startswith("seqckpt:")
    assert "Flip" in str(info.value)


def test_values_check_catches_value_drift() -> None:
    f = Flip("values")
    x = torch.randn(3, 2, requires_grad=True)
    y = checkpoint(f, x)  # default check: drift goes unseen
    f.flip = True
    y.sum().backward()
    f.flip = False
    y = checkpoint(f, x, determinism_check="values")
    f.flip = True
    with pytest.raises(CheckpointError, match="other values"):
        y.sum().backward()


# a generator held by a plain object: globals are walked into only where they
# are modules or generators themselves
NOISE_SOURCE = types.SimpleNamespace(generator=torch.Generator().manual_seed(3))


def test_values_check_names_a_generator_of_your_own() -> None:
    # A generator of the user's own that the region reaches through a global
    # object is not seen, so not replayed (as in torch): it has moved on by
    # the recompute, which draws other numbers.
    x = torch.randn(4, 4, requires_grad=True)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.rand(4, 4, generator=NOISE_SOURCE.generator)).exp()

    y = checkpoint(noisy, x, determinism_check="values")
    with pytest.raises(CheckpointError, match="torch.Generator of your own"):
        y.sum().backward()


def test_values_check_passes_on_deterministic_function() -> None:
    x = torch.randn(6, 8, requires_grad=True)
    assert_matches_plain(
        mlp(), x, lambda m, x: checkpoint(m, x, determinism_check="values")
    )


class SpectralMix(nn.Module):
    """FNet/Hyena-style mixing in the frequency domain: complex saved tensors,
    one of them a conjugate view (mul saves ``f.conj()`` as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft(self.proj(x), dim=-1)
        return torch.fft.irfft(f * f.conj() + f, n=16, dim=-1).tanh()


@pytest.mark.parametrize("check", ["default", "values"])
@pytest.mark.parametrize("policy", [None, "compute_heavy", "everything"])
def test_sparse_embedding_gradients(check: str, policy: str | None) -> None:
    # recommendation-style models: an embedding with sparse gradients
    keep: Any = (lambda op, *args, **kwargs: True) if policy == "everything" else policy
    assert_matches_plain(
        nn.Sequential(nn.Embedding(30, 8, sparse=True), nn.Linear(8, 8), nn.GELU()),
        torch.randint(0, 30, (4, 5)),
        lambda m, x: checkpoint(m, x, determinism_check=check, policy=keep),
    )


@pytest.mark.parametrize("check", ["default", "values", "none"])
@pytest.mark.parametrize("policy", [None, "everything"])
def test_complex_saved_tensors_conjugate_views_included(
    check: str, policy: str | None
) -> None:
    # "values" fingerprinted a conjugate view with view_as_real, which refuses
    # one ("unresolved conjugated tensors") and failed the backward.
    keep = (lambda op, *args, **kwargs: True) if policy else None
    assert_matches_plain(
        nn.Sequential(SpectralMix(), SpectralMix()),
        torch.randn(4, 16, requires_grad=True),
        lambda m, x: checkpoint(m, x, determinism_check=check, policy=keep),
    )


class _WithWorkspace(torch.autograd.Function):
    """An op that, as oneDNN's LSTM, saves a byte workspace whose bytes differ
    from call to call (unwritten memory there; a call counter here)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _WithWorkspace.calls += 1
        workspace = torch.full((64,), _WithWorkspace.calls % 256, dtype=torch.uint8)
        ctx.save_for_backward(x, workspace)
        return x.sin()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x, _ = ctx.saved_tensors
        return grad * x.cos()


@pytest.mark.parametrize("policy", [None, "everything"])
def test_values_check_reads_byte_workspaces_by_shape_only(policy: str | None) -> None:
    # "values" compared the workspace's bytes and raised a false CheckpointError
    keep = (lambda op, *args, **kwargs: True) if policy else None
    lin = nn.Linear(8, 8)
    assert_matches_plain(
        lin,
        torch.randn(4, 8, requires_grad=True),
        lambda m, x: checkpoint(
            lambda h: _WithWorkspace.apply(m(h)) * 2,
            x,
            determinism_check="values",
            policy=keep,
        ),
        plain=lambda m, x: _WithWorkspace.apply(m(x)) * 2,
    )


@pytest.mark.parametrize("check", ["default", "values"])
def test_stacked_lstm_with_dropout(check: str) -> None:
    # on the CPU its op (oneDNN's) saves a workspace with unwritten bytes
    assert_matches_plain(
        nn.LSTM(8, 8, num_layers=2, dropout=0.2, batch_first=True),
        torch.randn(2, 5, 8, requires_grad=True),
        lambda m, x: checkpoint(lambda h: m(h)[0], x, determinism_check=check),
        plain=lambda m, x: m(x)[0],
    )


def test_values_check_still_reads_other_integer_tensors() -> None:
    from seqckpt._fingerprint import fingerprint

    assert fingerprint(torch.zeros(64, dtype=torch.uint8)) is None
    assert fingerprint(torch.zeros(8, 8, dtype=torch.uint8)) is not None
    assert fingerprint(torch.zeros(64, dtype=torch.int64)) is not None


def test_none_check_still_counts() -> None:
    f = Flip("fewer")
    y = checkpoint(f, torch.randn(3, 2, requires_grad=True), determinism_check="none")
    f.flip = True
    with pytest.raises(CheckpointError, match="saved 0 tensors"):
        y.sum().backward()


def test_work_after_the_last_saved_tensor_is_not_recomputed() -> None:
    # The recompute stops once the forward's saved tensors are back: "more"
    # does extra work after exp's result, which the default check never sees
    # (and the gradient, from exp's result, is right); "values" runs to the end
    # and counts exactly.
    x = torch.randn(3, 2, requires_grad=True)
    f = Flip("more")
    y = checkpoint(f, x)
    f.flip = True
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, x.detach().exp())
    f.flip = False
    y = checkpoint(f, x, determinism_check="values")
    f.flip = True
    with pytest.raises(CheckpointError, match="saved 2 tensors"):
        y.sum().backward()


@pytest.mark.parametrize("scripted_head", [False, True])
def test_recompute_stops_after_the_last_saved_tensor(scripted_head: bool) -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        head: nn.Module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        if scripted_head:
            head = torch.jit.script(head)
        return nn.Sequential(head, CountsFinished())

    x = torch.randn(3, 4, requires_grad=True)
    assert_matches_plain(make, x, checkpoint)
    model = make()
    y = checkpoint(model, x)
    assert model[1].finished == 1
    y.sum().backward()
    assert model[1].finished == 1  # the recompute stopped inside the tail's matmul


def test_recompute_stops_across_torchscript() -> None:
    # The stop is raised inside the TorchScript interpreter, which turns it into
    # a RuntimeError; it is still recognised as the stop.
    def make() -> nn.Module:
        torch.manual_seed(0)
        return torch.jit.script(
            nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        )

    assert_matches_plain(make, torch.randn(3, 4, requires_grad=True), checkpoint)


def test_function_that_swallows_the_stop() -> None:
    class Stubborn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                y = self.lin(x)
            except Exception:  # catches the recompute's stop and carries on
                y = self.lin(x)
            return y.tanh()

    assert_matches_plain(Stubborn(), torch.randn(3, 4, requires_grad=True), checkpoint)


def test_user_exception_in_recompute_is_not_taken_for_the_stop() -> None:
    class FailsLater(nn.Module):
        fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise KeyError("boom")
            return x.exp()

    f = FailsLater()
    y = checkpoint(f, torch.randn(3, 2, requires_grad=True))
    f.fail = True
    with pytest.raises(KeyError, match="boom"):
        y.sum().backward()


def test_input_modified_in_place_after_call_raises() -> None:
    x = torch.randn(3, requires_grad=True)
    h = x * 1
    y = checkpoint(torch.exp, h)
    h.add_(1)
    with pytest.raises(CheckpointError, match="modified in place"):
        y.sum().backward()


# ------------------------------------------------------------------ flags


def test_flags_in_forward_and_recompute() -> None:
    seen: list[tuple[bool, bool]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append((seqckpt.is_checkpointing(), seqckpt.is_recomputing()))
        return x.exp()

    assert not seqckpt.is_checkpointing() and not seqckpt.is_recomputing()
    checkpoint(f, torch.randn(2, requires_grad=True)).sum().backward()
    assert seen == [(True, False), (False, True)]
    assert not seqckpt.is_checkpointing() and not seqckpt.is_recomputing()


def test_module_hooks_forward_twice_backward_once() -> None:
    def run(checkpointed: bool) -> tuple[list[str], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 4)
        )
        calls: list[str] = []
        grads: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda *a: calls.append("forward"))
        model[1].register_forward_hook(
            lambda *a: None if seqckpt.is_recomputing() else calls.append("collect")
        )
        model[3].register_full_backward_hook(
            lambda m, gi, go: grads.extend((gi[0], go[0]))
        )
        x = torch.randn(3, 4, requires_grad=True)
        y = checkpoint(model, x) if checkpointed else model(x)
        y.pow(2).sum().backward()
        return calls, grads

    plain_calls, plain_grads = run(False)
    calls, grads = run(True)
    assert plain_calls == ["forward", "collect"]
    assert calls == ["forward", "collect", "forward"]  # the recompute runs hooks too
    assert len(grads) == len(plain_grads) == 2
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))


def test_flags_are_thread_local() -> None:
    other: list[bool] = []
    started, release = threading.Event(), threading.Event()

    def watcher() -> None:
        started.wait()
        other.append(seqckpt.is_checkpointing())
        release.set()

    def f(x: torch.Tensor) -> torch.Tensor:
        started.set()
        release.wait(5)
        return x.exp()

    t = threading.Thread(target=watcher)
    t.start()
    checkpoint(f, torch.randn(2, requires_grad=True))
    t.join(5)
    assert other == [False]


def test_flags_restored_after_exception() -> None:
    def boom(x: torch.Tensor) -> torch.Tensor:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        checkpoint(boom, torch.randn(2, requires_grad=True))
    assert not seqckpt.is_checkpointing()

    state = {"fail": False}

    def fails_in_recompute(x: torch.Tensor) -> torch.Tensor:
        if state["fail"]:
            raise KeyError("recompute")
        return x.exp()

    y = checkpoint(fails_in_recompute, torch.randn(2, requires_grad=True))
    rng = torch.get_rng_state()
    state["fail"] = True
    with pytest.raises(KeyError, match="recompute"):
        y.sum().backward()
    assert not seqckpt.is_recomputing()
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.is_grad_enabled()


# ------------------------------------------------------------ buffers, JIT


class Counter(nn.Module):
    """Updates a buffer and reads it: the recompute must see the first value."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x * self.steps


@dataclasses.dataclass(slots=True)
class SlotRunner:
    """A callable holding its module in a slot (no ``__dict__``)."""

    block: nn.Module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class WeakHolder:
    """A callable holding its module through a weak reference."""

    def __init__(self, block: nn.Module) -> None:
        self.ref = weakref.ref(block)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        block = self.ref()
        assert block is not None
        return block(x)


class PrivateSlot:
    __slots__ = ("__block",)  # stored as _PrivateSlot__block

    def __init__(self, block: nn.Module) -> None:
        self.__block = block

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.__block(x)


def test_buffers_updated_once_and_recompute_sees_first_values() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Counter(), nn.Tanh())
    x = torch.randn(5, 4, requires_grad=True)
    assert_matches_plain(model, x, lambda m, x: checkpoint(m, x))
    # also when the module is reached through a closure
    assert_matches_plain(model, x, lambda m, x: checkpoint(lambda t: m(t), x))
    # or bound as a default argument, as loops bind their variable (the walk
    # did not look there: BatchNorm's statistics were updated twice)
    assert_matches_plain(model, x, lambda m, x: checkpoint(lambda t, b=m: b(t), x))
    assert_matches_plain(model, x, lambda m, x: checkpoint(lambda t, *, b=m: b(t), x))
    # or held in an object's slots (the walk read __dict__ only)
    assert_matches_plain(model, x, lambda m, x: checkpoint(SlotRunner(m), x))
    assert_matches_plain(model, x, lambda m, x: checkpoint(PrivateSlot(m).run, x))
    # in a deque, or behind a weak reference
    assert_matches_plain(
        model,
        x,
        lambda m, x: checkpoint(lambda t, d=collections.deque([m]): d[0](t), x),
    )
    assert_matches_plain(model, x, lambda m, x: checkpoint(WeakHolder(m), x))
    # or a global, as a script or notebook holds its model (the walk did not
    # read globals: BatchNorm's statistics updated twice, Counter's input
    # gradient off)
    assert_matches_plain(model, x, through_global(run_global_model))
    assert_matches_plain(model, x, through_global(run_global_in_loop))


def test_a_batch_norm_called_outside_the_region_too() -> None:
    """The op outside the region saves the running statistics without hooks,
    so autograd checks their version in backward; the recompute's writes of
    the first-run values, and of the caller's after it, used to move it:
    "modified by an inplace operation", where the plain run and torch's
    checkpoint train."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.out = (
                nn.Linear(4, 4),
                nn.BatchNorm1d(4),
                nn.Linear(4, 4),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.bn(self.lin(x))  # a plain call
            return checkpoint(lambda t: self.out(self.bn(t)).tanh(), h)

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m.out(m.bn(m.bn(m.lin(x)))).tanh()  # type: ignore[no-any-return]

    torch.manual_seed(0)
    assert_matches_plain(
        Shared(), torch.randn(5, 4, requires_grad=True), lambda m, x: m(x), plain
    )


GLOBAL_MODEL: nn.Module | None = None


def through_global(
    run: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        global GLOBAL_MODEL
        GLOBAL_MODEL = m  # the oracle's copy of the model
        return checkpoint(run, x)

    return call


def run_global_model(x: torch.Tensor) -> torch.Tensor:
    assert GLOBAL_MODEL is not None
    return GLOBAL_MODEL(x)


def run_global_in_loop(x: torch.Tensor) -> torch.Tensor:
    # the global named in a comprehension's own code object
    return [GLOBAL_MODEL(h) for h in (x,)][0]  # type: ignore[misc]


class EmaCodebook(nn.Module):
    """A vector quantizer whose codebook follows an exponential moving average
    of what it is assigned, updated in forward (VQ-VAE style), either in place
    under no_grad or, as older code does, through ``.data``."""

    def __init__(self, through_data: bool, entries: int = 6) -> None:
        super().__init__()
        self.through_data = through_data
        self.register_buffer("codes", torch.randn(entries, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.cdist(x, self.codes).argmin(-1)
        quantized = self.codes[index]
        if self.training:
            assigned = nn.functional.one_hot(index, len(self.codes)).to(x.dtype)
            mean = (assigned.T @ x.detach()) / (assigned.sum(0)[:, None] + 1)
            if self.through_data:
                self.codes.data.mul_(0.5).add_(mean, alpha=0.5)
            else:
                with torch.no_grad():
                    self.codes.mul_(0.5).add_(mean, alpha=0.5)
        return x * quantized


# a codebook of COPY_LIMIT bytes: copied at its first write, not up front
LARGE = seqckpt._buffers.COPY_LIMIT // 16


@pytest.mark.parametrize(
    ("through_data", "check", "entries"),
    [
        (False, "default", 6),
        (False, "values", 6),
        (True, "values", 6),
        (False, "default", LARGE),
        (True, "default", LARGE),
    ],
)
def test_buffer_written_in_forward_under_no_grad(
    through_data: bool, check: str, entries: int
) -> None:
    # A write through .data moves no version counter (.data hides it from
    # autograd), so of a small buffer (copied up front, kept where the version
    # moved) only "values", which keeps every floating-point buffer's first
    # value, sees it; the README states the limit and both remedies. A large
    # buffer is copied when an op is about to write into its memory, through
    # whatever alias: .data included.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), EmaCodebook(through_data, entries), nn.Linear(4, 4)
    )
    assert_matches_plain(
        model,
        torch.randn(5, 4, requires_grad=True),
        lambda m, x: checkpoint(m, x, determinism_check=check),
    )


class CausalScores(nn.Module):
    """Attention-like scores under a causal mask held as a buffer, as older HF
    GPT-2 and GPT-Neo layers hold theirs (``max_positions`` squared bools);
    ``shared`` puts one mask tensor in several modules."""

    def __init__(self, mask: torch.Tensor | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        if mask is None:
            mask = torch.ones(1024, 1024, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        n = x.shape[-2]
        scores = (h @ h.transpose(-1, -2)).masked_fill(~self.mask[:n, :n], -1e4)
        return scores.softmax(-1) @ h


def test_large_unwritten_buffer_is_not_copied() -> None:
    # Copied when the region starts, the 1 MiB mask made the checkpointed
    # step's peak several times torch's checkpoint's and the plain step's
    # (transformers 4.x GPT-2 at its default n_positions).
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    model = nn.Sequential(CausalScores(), nn.Tanh(), CausalScores(), nn.Tanh())
    x = torch.randn(2, 16, 8, requires_grad=True)
    assert_matches_plain(model, x, lambda m, x: checkpoint(m, x))
    peaks = {}
    for name, run in {
        "plain": lambda: model(x),
        "torch": lambda: torch_checkpoint(model, x, use_reentrant=False),
        "seqckpt": lambda: checkpoint(model, x),
    }.items():
        with seqckpt.track_memory() as mem:
            run().sum().backward()
        peaks[name] = mem.peak_bytes
    assert peaks["seqckpt"] <= peaks["torch"], peaks


class SeesModes(nn.Module):
    """Records how many dispatch modes are active in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(LARGE, 4))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch._C._len_torch_dispatch_stack())
        return x.sin() + self.table[0, 0]


def test_a_large_buffer_beside_larger_inputs_is_copied_up_front() -> None:
    # There the copy is a small part of the region's memory, and cheaper than
    # the dispatch mode that copies at the first write (Python per op).
    module = SeesModes()
    for rows in (8, 2 * LARGE):
        checkpoint(module, torch.randn(rows, 4, requires_grad=True)).sum().backward()
    assert module.seen == [1, 0]  # small input: watched; large: copied
    assert_matches_plain(
        SeesModes(),
        torch.randn(2 * LARGE, 4, requires_grad=True),
        lambda m, x: checkpoint(m, x),
    )


class WritesLargeBuffer(nn.Module):
    """Adds to a large buffer in forward, then uses it (a running table)."""

    def __init__(self, table: torch.Tensor | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        if table is None:
            table = torch.randn(LARGE, 4)
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.table[:8, :].add_(1.0)  # through a view
        return (self.proj(x) + self.table[:8, 0]).sin()


@pytest.mark.parametrize("rows", [8, LARGE])
def test_buffer_shared_by_modules_written_in_forward(rows: int) -> None:
    # One tensor in two modules' slots, written by both: the recompute starts
    # from its first values, and after backward it holds both writes (it held
    # only the first values again, the replay undone slot by slot).
    table = torch.randn(rows, 4)
    model = nn.Sequential(
        WritesLargeBuffer(table), nn.Tanh(), CausalScores(), WritesLargeBuffer(table)
    )
    x = torch.randn(3, 8, 8, requires_grad=True)
    assert_matches_plain(model, x, lambda m, x: checkpoint(m, x))


@pytest.mark.parametrize("rows", [8, LARGE])
def test_buffer_written_before_a_backward_inside_the_function(rows: int) -> None:
    # the recompute that this inner backward asks for (while the first run
    # goes on) must start from the table's first values too
    model = WritesLargeBuffer(torch.randn(rows, 4))

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def inner(x: torch.Tensor) -> torch.Tensor:
            y = m(x)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return y * g

        return inner(x)

    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(model, x, lambda m, x: checkpoint(run, m, x), plain=run)


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_module_passed_as_an_argument(by_keyword: bool) -> None:
    # checkpoint(run, block, x): the block's buffers (batch norm's running
    # statistics) are guarded as those of a module the callable holds; they
    # were updated twice before, as with torch's checkpoint.
    x = torch.randn(5, 8, requires_grad=True)
    assert_matches_plain(
        mlp(),
        x,
        (lambda m, x: checkpoint(_call, module=m, x=x))
        if by_keyword
        else (lambda m, x: checkpoint(_call, m, x)),
    )


class BumpsVersionUnseen(nn.Module):
    """Moves a large buffer's version counter without an op (as a kernel
    outside the dispatcher that reports its write would)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(LARGE, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.autograd.graph.increment_version(self.table)
        return x.sin() + self.table[0, 0]


def test_a_large_buffer_written_unseen_is_an_error() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"^seqckpt: buffer 'table' of Bumps"):
        checkpoint(BumpsVersionUnseen(), x)
    # copied up front under "values": no error, and right
    assert_matches_plain(
        BumpsVersionUnseen(),
        x,
        lambda m, x: checkpoint(m, x, determinism_check="values"),
    )


def scripted_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))),
        nn.Tanh(),
    )


def test_torchscript_module_inside() -> None:
    for _ in range(3):  # the profiling executor changes graphs over first calls
        x = torch.randn(4, 8, requires_grad=True)
        assert_matches_plain(scripted_model, x, lambda m, x: checkpoint(m, x))


def test_torchscript_module_is_the_region() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))

    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(make, x, lambda m, x: checkpoint(m, x))


# ------------------------------------------------------ no_grad, lifetime


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_plain_call_without_grad(context: type) -> None:
    inside: list[object] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        inside.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        inside.append(seqckpt.is_checkpointing())
        return x * 2

    with context():
        y = checkpoint(f, torch.randn(2, requires_grad=True))
    assert inside == [None, False]
    assert y.grad_fn is None


def test_graph_freed_by_reference_counting() -> None:
    gc.disable()
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        x = torch.randn(4, 8, requires_grad=True)
        h = x * 2
        ref_h = weakref.ref(h)
        y = checkpoint(model, h)
        ref_y = weakref.ref(y)
        y.sum().backward()
        del h, y
        assert ref_h() is None and ref_y() is None
        # without backward too
        h = x * 2
        ref_h = weakref.ref(h)
        y = checkpoint(model, h)
        del h, y
        assert ref_h() is None
    finally:
        gc.enable()


# ------------------------------------------------------------------ errors


def test_error_non_callable() -> None:
    with pytest.raises(TypeError, match=r"^seqckpt: argument 'function'.*42"):
        checkpoint(42, torch.randn(2))


def test_error_unknown_determinism_check() -> None:
    with pytest.raises(ValueError, match=r"^seqckpt: .*determinism_check.*'strict'"):
        checkpoint(torch.sin, torch.randn(2), determinism_check="strict")


def test_error_preserve_rng_state_not_bool() -> None:
    with pytest.raises(TypeError, match=r"^seqckpt: .*preserve_rng_state.*'yes'"):
        checkpoint(torch.sin, torch.randn(2), preserve_rng_state="yes")


# -------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_dropout_rng_and_autocast() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).cuda()
    x = torch.randn(16, 8, device="cuda", requires_grad=True)

    def step(use: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        torch.manual_seed(0)
        with torch.autocast("cuda", dtype=torch.float16):
            y = checkpoint(model, x) if use else model(x)
        y.float().sum().backward()
        return x.grad.clone(), torch.cuda.get_rng_state()

    got, ref = step(True), step(False)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.cuda
def test_cuda_rng_of_device_used_with_cpu_inputs() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, device="cuda")
        return (x.cuda() * noise).sum()

    x = torch.randn(100, requires_grad=True)
    torch.cuda.init()
    torch.manual_seed(0)
    checkpoint(f, x).backward()
    got = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    f(x).backward()
    assert torch.equal(got, x.grad)


# ------------------------------------------- buffers of modules however reached


def bn_blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Tanh(), Counter()]
    )


def timm_checkpoint_seq(
    functions: Any, x: torch.Tensor, every: int = 2, using: Any = checkpoint
) -> Any:
    """timm's checkpoint_seq: a closure over a tuple of modules per chunk
    (``using``: the checkpoint function it calls)."""

    def run_function(start: int, end: int, fns: Any) -> Callable[..., Any]:
        def forward(h: torch.Tensor) -> torch.Tensor:
            for j in range(start, end + 1):
                h = fns[j](h)
            return h

        return forward

    fns = tuple(functions)
    for start in range(0, len(fns), every):
        end = min(start + every - 1, len(fns) - 1)
        x = using(run_function(start, end, fns), x, use_reentrant=False)
    return x


def each_block_its_region(m: nn.ModuleList, x: torch.Tensor) -> Any:
    return timm_checkpoint_seq(m, x, every=1)


class Stages:
    """A callable object holding modules in a dict attribute."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.parts = {"all": list(blocks)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.parts["all"]:
            x = block(x)
        return x


def in_list_closure(m: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    blocks = [m[0], m[1], m[2]]  # torch's run_function(start, end, functions)

    def run(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = block(h)
        return h

    return checkpoint(run, x)


def in_partial_dict(m: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    def run(parts: dict[str, nn.Module], h: torch.Tensor) -> torch.Tensor:
        return parts["c"](parts["b"](parts["a"](h)))

    return checkpoint(functools.partial(run, {"a": m[0], "b": m[1], "c": m[2]}), x)


class Trainer:
    """A plain (not callable, not a module) object holding the model, as a
    training script's own class does."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.model = blocks

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda h: run_all(self.model, h), x)


def run_all(m: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in m:
        x = block(x)
    return x


@pytest.mark.parametrize(
    "call",
    [
        timm_checkpoint_seq,
        in_list_closure,
        in_partial_dict,
        lambda m, x: checkpoint(Stages(m), x),
        lambda m, x: Trainer(m).step(x),
    ],
    ids=[
        "timm-checkpoint-seq",
        "list-in-closure",
        "dict-in-partial",
        "object",
        "lambda-over-plain-object",
    ],
)
def test_buffers_of_modules_reached_through_containers(call: Any) -> None:
    x = torch.randn(6, 4, requires_grad=True)
    assert_matches_plain(bn_blocks(), x, call, plain=run_all)


def test_a_closure_over_every_block_keeps_only_the_statistics_it_updates() -> None:
    # timm's checkpoint_seq closes over all of a model's blocks and runs a few
    # per region. Each region kept its first-run copy of every block's running
    # statistics until backward (timm resnet50 at 32x32 through
    # set_grad_checkpointing(): peak 13.46 MiB, plain 12.49, torch's
    # checkpoint 10.24); a batch norm whose num_batches_tracked did not move
    # did not run, and needs none.
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)) for _ in range(24)
    )
    x = torch.randn(2, 64, requires_grad=True)
    assert_matches_plain(blocks, x, each_block_its_region, plain=run_all)
    for p in blocks.parameters():  # allocated before, as in a training loop
        p.grad = torch.zeros_like(p)
    peaks = {}
    for name, using in {"torch": torch_checkpoint, "seqckpt": checkpoint}.items():
        with seqckpt.track_memory() as mem:
            timm_checkpoint_seq(blocks, x, every=1, using=using).sum().backward()
        peaks[name] = mem.peak_bytes
    # beyond torch's (which updates the statistics twice): one first-run copy
    # of the statistics of each block, kept by the one region that runs it
    statistics = sum(b.numel() * b.element_size() for b in blocks.buffers())
    assert peaks["seqckpt"] <= peaks["torch"] + statistics, peaks


class UncountedBatchNorm(nn.BatchNorm1d):
    """Updates its running statistics without counting the update in
    ``num_batches_tracked``: nothing shows that it ran."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias,
            True, 0.1, self.eps,
        )  # fmt: skip


def test_a_batch_norm_that_does_not_count_its_updates_keeps_its_copies() -> None:
    # Only forwards known to count (torch's, timm's copy of it) let a region
    # drop the copies of statistics whose counter did not move.
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(4, 4), UncountedBatchNorm(4)) for _ in range(3)
    )
    x = torch.randn(6, 4, requires_grad=True)
    assert_matches_plain(blocks, x, each_block_its_region, plain=run_all)


class Samples:
    def __init__(self) -> None:
        self.rows = list(range(100_000))
        self.index = {str(i): [i] for i in range(1000)}


def test_the_module_walk_is_bounded_and_finds_the_nearest_modules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A lambda over a script's object that holds a dataset before the model:
    # the walk (it runs at every call of a region) must not look through the
    # whole dataset, and must still find the model next to it.
    from seqckpt import _buffers

    looked: list[object] = []
    held_by = _buffers._held_by

    def counting(obj: object) -> Any:
        for item in held_by(obj):
            looked.append(item)
            yield item

    monkeypatch.setattr(_buffers, "_held_by", counting)

    class Script:
        def __init__(self, model: nn.ModuleList) -> None:
            self.data = Samples()
            self.model = model

    def call(m: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        script = Script(m)
        return checkpoint(lambda h: run_all(script.model, h), x)

    x = torch.randn(6, 4, requires_grad=True)
    assert_matches_plain(bn_blocks(), x, call, plain=run_all)
    assert 0 < len(looked) <= _buffers._WALK_BUDGET  # one region call


class RaisingLookup:
    """An object whose failed attribute lookups raise something else than
    AttributeError (a proxy's, a config's)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"no attribute {name}")


class GuardedProxy:
    """An object whose ``__getattribute__`` refuses ``__dict__``."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            raise KeyError(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("holder", [RaisingLookup, GuardedProxy])
def test_the_module_walk_runs_no_attribute_hooks_of_the_objects_it_meets(
    holder: Any,
) -> None:
    # The walk reads attributes as plain lookup finds them: a class's own
    # __getattr__ / __getattribute__ is not run (they raised out of checkpoint).
    def call(m: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        held = holder(m)
        return checkpoint(lambda h: run_all(held.block, h), x)

    x = torch.randn(6, 4, requires_grad=True)
    assert_matches_plain(bn_blocks(), x, call, plain=run_all)


GLOBAL_BN = nn.BatchNorm1d(4)
GLOBAL_HOLDER = types.SimpleNamespace(bn=nn.BatchNorm1d(4))


def through_global_module(x: torch.Tensor) -> torch.Tensor:
    return GLOBAL_BN(x).tanh()


def through_global_object(x: torch.Tensor) -> torch.Tensor:
    return GLOBAL_HOLDER.bn(x).tanh()


@pytest.mark.parametrize(
    ("function", "check"),
    [
        (through_global_module, "default"),  # a global the code names
        (through_global_module, "values"),
        (through_global_object, "values"),  # only the module hook sees it
    ],
)
def test_a_module_reached_through_a_global(function: Any, check: str) -> None:
    bn = GLOBAL_BN if function is through_global_module else GLOBAL_HOLDER.bn
    x = torch.randn(6, 4, requires_grad=True)
    ref = bn.running_mean.clone()
    checkpoint(function, x, determinism_check=check).sum().backward()
    once = bn.running_mean.clone()
    bn.running_mean.copy_(ref)
    bn(x)
    assert torch.equal(once, bn.running_mean)  # updated once


class NamesLikeAGlobal:
    """Holds its block under the name of a global module."""

    def __init__(self, block: nn.Module) -> None:
        self.GLOBAL_BN = block

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.GLOBAL_BN(x)


def test_an_attribute_named_like_a_global_does_not_reach_the_global() -> None:
    # Only names the code loads as globals are looked up in its namespace:
    # ``self.GLOBAL_BN`` is an attribute (a whole model's buffers guarded at
    # every region call would cost a copy of each).
    block = nn.Linear(4, 4)
    assert seqckpt._buffers.modules_of(NamesLikeAGlobal(block).run) == [block]


class CodeLike:
    """A callable with ``__code__`` and ``__globals__`` attributes that are
    not a function's (a wrapper imitating one)."""

    __code__ = "not code"
    __globals__ = 3

    def __call__(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)


def test_a_method_of_a_callable_imitating_a_function() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh())
    x = torch.randn(5, 4, requires_grad=True)
    assert_matches_plain(
        model, x, lambda m, t: checkpoint(types.MethodType(CodeLike(), m), t)
    )


class Rebinds(nn.Module):
    """Replaces its buffer instead of writing into it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return x * self.steps


def test_a_buffer_replaced_by_the_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Rebinds(), nn.Tanh())
    x = torch.randn(2, 3, requires_grad=True)
    assert_matches_plain(model, x, lambda m, t: checkpoint(m, t))


def _then_eval(output: Any, model: nn.Module) -> Any:
    model.eval()  # e.g. an evaluation between forward and backward
    return output


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: _then_eval(checkpoint(m, x), m),
        lambda m, x: _then_eval(seqckpt.checkpoint_sequential(m, 3, x), m),
    ],
    ids=["whole", "segments"],
)
def test_recompute_runs_in_the_training_modes_of_the_forward(call: Any) -> None:
    # model.eval() before backward must not turn dropout off or batch norm to
    # its running statistics in the recompute (torch's checkpoint raises:
    # other saved tensors); the caller's modes are back afterwards. The
    # dropout is used twice: a shared module is set back once.
    dropout = nn.Dropout(0.3)
    model = nn.Sequential(
        nn.Linear(6, 6), dropout, nn.Linear(6, 6), nn.BatchNorm1d(6),
        nn.GELU(), dropout, nn.Linear(6, 6),
    )  # fmt: skip
    x = torch.randn(5, 6, requires_grad=True)
    assert_matches_plain(model, x, call, plain=lambda m, t: _then_eval(m(t), m))
    ran = copy.deepcopy(model).train()
    call(ran, x).sum().backward()
    assert not any(m.training for m in ran.modules())


class FreezesItsNorm(nn.Module):
    """Puts its batch norm in eval mode during its own forward (frozen
    statistics, as detection backbones do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.norm.eval()
        return self.drop(self.norm(self.lin(x))).tanh()


def test_a_forward_that_sets_modes_itself() -> None:
    # The recompute starts from the modes its forward started from, and the
    # caller gets the modes the forward left (the norm in eval), not toggled.
    x = torch.randn(5, 4, requires_grad=True)
    assert_matches_plain(FreezesItsNorm(), x, lambda m, t: checkpoint(m, t))
    model = FreezesItsNorm()
    checkpoint(model, x).sum().backward()
    assert model.training and model.drop.training and not model.norm.training


class HeadRemoved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.head = None  # a registered submodule slot set to None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).tanh()


def test_a_submodule_slot_set_to_none() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    assert_matches_plain(HeadRemoved(), x, lambda m, t: checkpoint(m, t))


def qat_chain(qconfig: str, observed: bool) -> nn.Module:
    """A chain prepared for quantization-aware training (torch.ao): every
    layer's weight and activation pass through fake-quantizers whose observers
    update their statistics, scale and zero point in forward."""
    import torch.ao.quantization as quant

    torch.manual_seed(0)
    model = nn.Sequential(
        quant.QuantStub(),
        nn.Linear(6, 8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.GELU(),
        nn.Linear(8, 3),
        quant.DeQuantStub(),
    )
    model.qconfig = (
        quant.get_default_qat_qconfig("x86")  # the fused kernel
        if qconfig == "fused"
        else quant.get_default_qat_qconfig("fbgemm", version=0)  # per channel
    )
    with warnings.catch_warnings():  # torch.ao's deprecation notices
        warnings.simplefilter("ignore")
        model = quant.prepare_qat(model.train())
    if observed:  # observers past their first batch: a second update moves them
        model(torch.randn(5, 6))
    return model


@pytest.mark.parametrize("observed", [False, True], ids=["fresh", "observed"])
@pytest.mark.parametrize("qconfig", ["fused", "per-channel"])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: checkpoint(m, x),
        lambda m, x: seqckpt.checkpoint_sequential(m, 2, x),
    ],
    ids=["whole", "segments"],
)
def test_quantization_aware_training(qconfig: str, observed: bool, call: Any) -> None:
    # The fused fake-quantize kernel writes its buffers without moving their
    # version counters (the recompute saw the updated scale, and observers
    # were updated twice); per-channel observers start with empty min/max
    # that the first batch resizes (putting the first-run values back failed).
    x = torch.randn(5, 6, requires_grad=True)
    assert_matches_plain(qat_chain(qconfig, observed), x, call)


@pytest.mark.parametrize("form", ["parametrization", "hook"])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: checkpoint(m, x),
        lambda m, x: checkpoint(m, x, policy="compute_heavy"),
        lambda m, x: seqckpt.checkpoint_sequential(m, 2, x),
    ],
    ids=["whole", "compute_heavy", "segments"],
)
def test_spectral_norm_iterates_once_per_step(form: str, call: Any) -> None:
    # Spectral normalisation (GAN discriminators) runs a power iteration in
    # every training forward and writes its vectors u, v in place. A
    # recompute that iterated again from the updated vectors would divide by
    # another sigma (other gradients, no error: torch's checkpoint does so)
    # and leave the vectors one iteration further than the plain run.
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    if form == "parametrization":
        norm = parametrizations.spectral_norm
    else:  # the older form: a forward pre-hook and buffers on the module
        norm = torch.nn.utils.spectral_norm  # type: ignore[assignment]
    model = nn.Sequential(
        norm(nn.Linear(6, 6)), nn.LeakyReLU(0.2), norm(nn.Linear(6, 6)), nn.Tanh()
    )
    x = torch.randn(4, 6, requires_grad=True)
    assert_matches_plain(model, x, call)


@pytest.mark.parametrize("cached_in", ["forward", "backward"])
def test_parametrization_cache_is_replayed(cached_in: str) -> None:
    # Under parametrize.cached() the first region computes the orthogonal
    # weight and caches it; later regions use the cached tensor. Each
    # recompute must do what its forward did: compute it, or take it from the
    # cache as it was (torch's checkpoint computes it in every recompute and
    # raises); a backward inside cached() must not lend its cache to them.
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    cell = parametrizations.orthogonal(nn.Linear(6, 6))
    x = torch.randn(3, 6)

    def grads(use: bool) -> list[torch.Tensor | None]:
        cell.zero_grad()
        h = start = x.clone().requires_grad_()
        with parametrize.cached() if cached_in == "forward" else nullcontext():
            for _ in range(4):  # a recurrent cell, checkpointed per step
                h = checkpoint(lambda t: cell(t).tanh(), h) if use else cell(h).tanh()
        with parametrize.cached() if cached_in == "backward" else nullcontext():
            h.square().sum().backward()
        return [start.grad, *(p.grad for p in cell.parameters())]

    plain = grads(False)
    assert all(
        torch.equal(a, b)  # type: ignore[arg-type]
        for a, b in zip(grads(True), plain, strict=True)
    )
    assert parametrize._cache_enabled == 0 and not parametrize._cache


def test_a_cache_switch_in_forward_hooks_survives_the_early_stop() -> None:
    # bitsandbytes turns parametrize's cache on in a module's forward pre-hook
    # and off in its forward hook. A recompute that stops early inside that
    # module never runs the forward hook (torch's checkpoint leaves the cache
    # on for good, so later steps use stale weights); the region gives the
    # caller back the cache as it was.
    from torch.nn.utils import parametrizations, parametrize

    def cache_on(module: nn.Module, args: object) -> None:
        parametrize._cache_enabled += 1

    def cache_off(module: nn.Module, args: object, output: object) -> None:
        parametrize._cache_enabled -= 1
        if not parametrize._cache_enabled:
            parametrize._cache = {}

    def train(use: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        tail = parametrizations.orthogonal(nn.Linear(6, 6))
        tail.register_forward_pre_hook(cache_on)
        tail.register_forward_hook(cache_off)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), tail)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(3, 6, requires_grad=True)
        out = []
        for _ in range(3):
            opt.zero_grad()
            y = checkpoint(model, x) if use else model(x)
            y.square().sum().backward()
            assert parametrize._cache_enabled == 0 and not parametrize._cache
            out += [y.detach(), *(p.grad for p in model.parameters())]
            opt.step()
        return out

    assert all(
        torch.equal(a, b)  # type: ignore[arg-type]
        for a, b in zip(train(True), train(False), strict=True)
    )


# ------------------------------------------------------------ backend switches


def test_sdpa_backend_chosen_in_forward_is_used_in_the_recompute() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    # dropout 0: with dropout the CPU falls back to the math path anyway
    layer = nn.TransformerEncoderLayer(
        16, 2, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    x = torch.randn(2, 5, 16, requires_grad=True)

    def step(m: nn.Module, t: torch.Tensor, use: bool) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return checkpoint(m, t) if use else m(t)

    # the backward (and so the recompute) runs after the `with` block has ended
    assert_matches_plain(
        layer,
        x,
        lambda m, t: step(m, t, True),
        plain=lambda m, t: step(m, t, False),
    )


SWITCHES = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype, torch.float64),
    "deterministic": (
        torch.are_deterministic_algorithms_enabled,
        torch.use_deterministic_algorithms,
        True,
    ),
    "matmul precision": (
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
        "medium",
    ),
    "mkldnn": (
        lambda: torch.backends.mkldnn.enabled,
        lambda v: setattr(torch.backends.mkldnn, "enabled", v),
        False,
    ),
    "flash sdp": (
        torch.backends.cuda.flash_sdp_enabled,
        torch.backends.cuda.enable_flash_sdp,
        False,
    ),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_backend_switches_of_the_forward_are_replayed(name: str) -> None:
    get, put, other = SWITCHES[name]
    usual = get()
    seen: list[object] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(get())
        return x.exp()

    x = torch.randn(3, dtype=torch.float32, requires_grad=True)
    put(other)
    try:
        y = checkpoint(f, x)
    finally:
        put(usual)
    y.sum().backward()  # the caller's value is the usual one again
    assert seen == [other, other]
    assert get() == usual


# ----------------------------------------------------- in-place first layer


def test_a_function_that_writes_into_its_input_is_refused_in_forward() -> None:
    h = torch.randn(4, requires_grad=True) * 1
    with pytest.raises(CheckpointError, match="modified its own input in place"):
        checkpoint(nn.Sequential(nn.ReLU(inplace=True), nn.Tanh()), h)


@pytest.mark.parametrize(
    ("run", "name"),
    [
        (lambda m, x: checkpoint(m, x), "SavesLessTheSecondTime"),
        # HF calls partial(super().__call__, **kwargs): named by its module
        (lambda m, x: checkpoint(functools.partial(m.__call__), x), "SavesLess"),
        (lambda m, x: checkpoint(lambda t: m(t), x), "<lambda>"),
        # a stretch of a chain: named by its layers
        (
            lambda m, x: seqckpt.checkpoint_sequential([m, nn.Tanh()], 2, x),
            "layers 0-0",
        ),
    ],
)
def test_errors_name_the_checkpointed_function(run: Any, name: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match=f"checkpointed {name}"):
        run(SavesLessTheSecondTime(), x).sum().backward()


def test_a_lazy_module_first_call_runs_plainly_then_is_checkpointed() -> None:
    # Its first call draws random numbers to initialize its weights; a
    # recompute would not, so dropout after it would draw another mask
    # (torch's checkpoint gives wrong gradients here without a word).
    def lazy_chain() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(4), nn.Dropout(0.5), nn.Tanh())

    x = torch.randn(3, 5, requires_grad=True)
    with pytest.warns(UserWarning, match="LazyLinear initializes its parameters"):
        assert_matches_plain(lazy_chain, x, lambda m, t: checkpoint(m, t))
    model = lazy_chain()
    model(x)  # initialized: from now on checkpointed
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda *_: seen.append(seqckpt.is_recomputing()))
    checkpoint(model, x).sum().backward()
    assert seen == [False, True]


def test_regions_on_cuda_capture_the_cuda_switches_too() -> None:
    # CUDA-only switches (cuDNN, cuBLAS, the CUDA attention backends) cannot
    # change what runs on the CPU, so CPU regions skip them; a region on a CUDA
    # device reads them all. Checked without a GPU on the capture itself.
    cpu = seqckpt._state.Ambient(())
    cuda = seqckpt._state.Ambient((torch.device("cuda", 0),))
    assert cpu.switches is seqckpt._state.CPU_SWITCHES
    assert cuda.switches is seqckpt._state.ALL_SWITCHES
    assert len(cuda.values) > len(cpu.values)
    getters = [get for get, _ in cuda.switches]
    assert torch._C._get_cudnn_benchmark in getters
    usual = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = not usual
        undo = cuda.replay()  # back to the captured value, and undone after
        assert torch.backends.cudnn.benchmark == usual
        seqckpt._state.Ambient.undo(undo)
        assert torch.backends.cudnn.benchmark == (not usual)
    finally:
        torch.backends.cudnn.benchmark = usual


def test_mixed_tf32_apis_do_not_break_the_capture() -> None:
    # After the legacy and the fp32-precision APIs were both used, torch's
    # legacy getter raises; capturing and replaying the switches must not.
    c = torch._C
    if not hasattr(c, "_get_fp32_precision_getter"):
        pytest.skip("this torch has no fp32-precision API")
    usual = c._get_fp32_precision_getter("mkldnn", "matmul")
    try:
        c._set_fp32_precision_setter("mkldnn", "matmul", "bf16")
        x = torch.randn(3, requires_grad=True)
        checkpoint(lambda t: t.exp(), x).sum().backward()
        assert torch.equal(x.grad, x.detach().exp())
    finally:
        c._set_fp32_precision_setter("mkldnn", "matmul", usual)


# ------------------------------------------------- device synchronisation


SYNCING = {
    "equal",
    "_local_scalar_dense",
    "is_nonzero",
    "item",
    "nonzero",
    "allclose",
    "masked_select",
    "unique",
    "_unique2",
}


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[misc]
    """Counts the aten ops that make the host wait for the device (a CUDA
    synchronisation each), so a CPU run shows what a GPU run would sync."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ in SYNCING:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def sync_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(
                nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.GELU()
            )
            for _ in range(6)
        ]
    )


@pytest.mark.parametrize(
    ("check", "bound"), [("default", 0), ("none", 0), ("values", 1)]
)
def test_no_host_sync_per_region(check: str, bound: int) -> None:
    from seqckpt.planner import Plan, Recompute, Run

    plan = Plan(
        (
            Recompute(0, 3, Plan((Recompute(0, 2, Plan((Run(0, 2),))), Run(2, 3)))),
            Recompute(3, 5, Plan((Run(3, 5),))),
            Run(5, 6),
        )
    )
    x = torch.randn(16, 8, requires_grad=True)
    model = sync_model()
    with SyncCounter() as plain:
        model(x).sum().backward()
    with SyncCounter() as ckpt:
        seqckpt.checkpoint_sequential(
            model, plan, x, determinism_check=check
        ).sum().backward()
    assert plain.found == []
    # "values" compares each region's fingerprints once: one sync per region.
    assert len(ckpt.found) <= bound * plan.checkpoints(), ckpt.found
    if check == "values":
        assert ckpt.found, "the comparison this test counts is missing"


class FakePhilox:
    """A CUDA generator's state as seqckpt reads it: a seed and an offset that
    draws advance. Stands in for torch.cuda.default_generators on the CPU."""

    def __init__(self, seed: int) -> None:
        self.seed, self.offset, self.reseeded = seed, 0, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def manual_seed(self, seed: int) -> None:
        self.seed, self.offset = seed, 0
        self.reseeded += 1

    def set_offset(self, offset: int) -> None:
        self.offset = offset

    def draw(self) -> float:
        self.offset += 4
        return float(self.offset)


def test_rng_of_every_cuda_device_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The region's input is on the CPU, yet it draws on "device 1": the
    # recompute must see device 1's first-run offset, and the caller must find
    # each device as a plain run leaves it.
    fakes = (FakePhilox(7), FakePhilox(8))
    monkeypatch.setattr(seqckpt._state, "cuda_generators", lambda: fakes)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * fakes[1].draw()).sin()

    x = torch.randn(4, requires_grad=True)
    y = checkpoint(f, x)
    assert fakes[1].offset == 4
    fakes[1].draw()  # the caller draws between forward and backward
    y.sum().backward()
    assert torch.equal(x.grad, 4 * (4 * x.detach()).cos())
    assert (fakes[0].offset, fakes[1].offset) == (0, 8)
    assert fakes[0].reseeded == 0  # untouched devices are left alone


@pytest.mark.cuda
def test_cuda_backward_on_another_stream_than_the_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).cuda()
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    forward_stream, backward_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def run(use: bool) -> torch.Tensor:
        x.grad = None
        forward_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(forward_stream):
            y = checkpoint(model, x * 2) if use else model(x * 2)
        backward_stream.wait_stream(forward_stream)
        with torch.cuda.stream(backward_stream):
            y.sum().backward()
        torch.cuda.current_stream().wait_stream(backward_stream)
        torch.cuda.synchronize()
        return x.grad.clone()

    assert torch.allclose(run(True), run(False), rtol=1e-5, atol=1e-6)


def test_checkpoint_error_goes_by_its_public_name() -> None:
    # raised from a private module, shown and pickled as seqckpt.CheckpointError
    import pickle

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(torch.sin, x)
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(CheckpointError) as raised:
        y.sum().backward()
    kind = type(raised.value)
    assert f"{kind.__module__}.{kind.__qualname__}" == "seqckpt.CheckpointError"
    again = pickle.loads(pickle.dumps(raised.value))
    assert type(again) is CheckpointError and str(again) == str(raised.value)
