"""seqckpt.checkpoint as a drop-in for torch.utils.checkpoint.checkpoint.

Two parts: torch's keywords as real call sites pass them (HF, timm, Lightning),
and the behaviours that PyTorch's own checkpoint tests pin down (TestCheckpoint
in test_utils.py, the checkpoint tests of TestAutograd and TestNestedCheckpoint
in test_autograd.py), written anew for seqckpt. Where seqckpt deliberately
differs from torch the test says so.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import re
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import seqckpt
from seqckpt import CheckpointError, _options, checkpoint, checkpoint_sequential
from seqckpt.memory import track_memory
from tests.counting import CountsFinished, OpCounter, SavesLessTheSecondTime
from tests.distributed_workers import Residual
from tests.oracle import assert_matches_plain

aten = torch.ops.aten

# ------------------------------------------------------------ torch's keywords


def test_torch_keywords_are_never_passed_to_the_function() -> None:
    received: list[dict[str, Any]] = []

    def f(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        received.append(kwargs)
        return x.exp()

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(
        f,
        x,
        use_reentrant=False,
        context_fn=tc.noop_context_fn,
        determinism_check="default",
        debug=False,
        early_stop=True,
        preserve_rng_state=True,
        scale=2,
    )
    y.sum().backward()
    assert received == [{"scale": 2}, {"scale": 2}]  # forward and recompute


def test_torchs_default_context_fn_is_no_context_fn() -> None:
    # Wrappers that pass torch's defaults on (context_fn=noop_context_fn) get
    # the plain default options, without two empty contexts per region.
    from seqckpt._options import DEFAULT_OPTIONS, make_options

    assert make_options(context_fn=tc.noop_context_fn) is DEFAULT_OPTIONS
    assert make_options(context_fn=lambda: tc.noop_context_fn()) != DEFAULT_OPTIONS


@pytest.mark.parametrize("use_reentrant", [None, False, True])
def test_use_reentrant_is_accepted_and_changes_nothing(
    use_reentrant: bool | None,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.GELU())
    x = torch.randn(3, 4)  # no input grad: the reentrant limit seqckpt lifts
    assert_matches_plain(
        model, x, lambda m, t: checkpoint(m, t, use_reentrant=use_reentrant)
    )


def test_a_module_called_as_hf_and_timm_call_it() -> None:
    # HF: self._gradient_checkpointing_func(layer.__call__, *args); timm:
    # checkpoint(module, x) with use_reentrant from its own default.
    layer = nn.Linear(4, 4)
    hf_func = functools.partial(checkpoint, use_reentrant=False)
    x = torch.randn(2, 4, requires_grad=True)
    assert_matches_plain(layer, x, lambda m, t: hf_func(m.__call__, t))
    assert_matches_plain(layer, x, lambda m, t: checkpoint(m, t, use_reentrant=True))


class _ScaledBlock(nn.Module):
    """A block taking a keyword argument, counting its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2))
        self.out = nn.Linear(16, 8)
        self.runs = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.runs += 1
        return self.out(self.inner(x) * scale)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ScaledBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=2.0)
        return x


def test_torch_distributed_checkpoint_wrapper_takes_seqckpt() -> None:
    # FSDP users (torchtitan among them) wrap blocks with torch's
    # apply_activation_checkpointing; checkpoint_fn= makes the wrapper call
    # seqckpt, with the block's keyword arguments passed through.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    def wrap(model: nn.Module) -> nn.Module:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_fn=seqckpt.checkpoint
            ),
            check_fn=lambda m: isinstance(m, _ScaledBlock),
        )
        return model

    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(model, x, lambda m, t: wrap(m)(t))
    wrapped = wrap(model)
    wrapped(x).sum().backward()
    runs = [b._checkpoint_wrapped_module.runs for b in wrapped.blocks]
    assert runs == [2, 2, 2]  # a forward and a recompute each
    assert list(wrapped.state_dict()) == list(_Stack().state_dict())


class _BiasFreeBlock(nn.Module):
    """Two matmuls (linears without bias), GELU and dropout between them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(nn.functional.gelu(self.up(x))))


def _every_other_mm_context() -> tuple[Any, Any]:
    """torchtitan's "op" selective checkpointing: a fresh counter per call,
    one count per mode, every matmul kept but each second one."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tc.CheckpointPolicy:
        if op is not aten.mm.default:
            return tc.CheckpointPolicy.PREFER_RECOMPUTE
        mode = "recompute" if ctx.is_recompute else "forward"
        counts[mode] += 1
        if counts[mode] % 2 == 0:
            return tc.CheckpointPolicy.PREFER_RECOMPUTE
        return tc.CheckpointPolicy.MUST_SAVE

    return tc.create_selective_checkpoint_contexts(policy)


def test_torchtitans_counting_policy_through_the_checkpoint_wrapper() -> None:
    # torchtitan wraps each block with checkpoint_wrapper(context_fn=...,
    # preserve_rng_state=..., determinism_check=..., early_stop=..., debug=...);
    # with checkpoint_fn=seqckpt.checkpoint those keywords reach seqckpt, and
    # its policy keeps and recomputes the same matmuls as torch's checkpoint.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    keywords: dict[str, Any] = {
        "context_fn": _every_other_mm_context,
        "preserve_rng_state": True,
        "determinism_check": "default",
        "early_stop": True,
        "debug": False,
    }
    if "early_stop" not in inspect.signature(tc.checkpoint).parameters:
        del keywords["early_stop"]  # torch 2.8's passes it on to the block

    def titan(fn: Any) -> Callable[[nn.Module], nn.Module]:
        # fn None: the wrapper's own default, torch's non-reentrant checkpoint
        def wrap(model: nn.Module) -> nn.Module:
            for i, block in enumerate(model):
                model[i] = checkpoint_wrapper(block, checkpoint_fn=fn, **keywords)
            return model

        return wrap

    def without_policy(function: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("context_fn")
        return seqckpt.checkpoint(function, *args, **kwargs)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(_BiasFreeBlock() for _ in range(3)))

    def mm_in_backward(model: nn.Module) -> int:
        y = model(torch.randn(4, 8, requires_grad=True))
        with OpCounter() as counter:
            y.sum().backward()
        return counter.counts.get("mm", 0)

    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(build, x, lambda m, t: titan(seqckpt.checkpoint)(m)(t))
    ours = mm_in_backward(titan(seqckpt.checkpoint)(build()))
    torchs = mm_in_backward(titan(None)(build()))
    everything_recomputed = mm_in_backward(titan(without_policy)(build()))
    assert ours == torchs
    assert everything_recomputed - ours == 3  # the first matmul of each block kept


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("use_reentrant", "no"),
        ("debug", 1),
        ("early_stop", None),
        ("preserve_rng_state", "yes"),
        ("context_fn", 3),
    ],
)
def test_bad_keyword_values_are_named(keyword: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"^seqckpt: argument '{keyword}'"):
        checkpoint(torch.sin, torch.randn(2), **{keyword: value})


@pytest.mark.parametrize(("early_stop", "runs"), [(True, 1), (False, 2)])
def test_early_stop_keyword(early_stop: bool, runs: int) -> None:
    tail = CountsFinished()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), tail)
    y = checkpoint(model, torch.randn(3, 4, requires_grad=True), early_stop=early_stop)
    y.sum().backward()
    assert tail.finished == runs


def test_debug_names_the_first_op_that_differs() -> None:
    state = {"flip": False}

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.cos() if state["flip"] else x.exp().sin()).sum()

    y = checkpoint(f, torch.randn(3, requires_grad=True), debug=True)
    state["flip"] = True
    with pytest.raises(CheckpointError, match=r"first differ at op #0") as info:
        y.backward()
    assert "aten.exp" in str(info.value) and "aten.cos" in str(info.value)


def test_debug_logs_only_the_functions_ops() -> None:
    # BatchNorm's statistics are put back before the recompute (clone, copy_)
    # and the hooks detach what they collect: none of that is in either log,
    # so the logs first differ where the function does (op #6, not #0).
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), SavesLessTheSecondTime())
    x = torch.randn(5, 4, requires_grad=True)
    y = checkpoint(model, x, debug=True)
    with pytest.raises(CheckpointError) as info:
        y.sum().backward()
    message = str(info.value)
    found = re.search(
        r"forward ran (\d+) ops, the recompute (\d+); .* op #(\d+)", message
    )
    assert found is not None, message
    forward, recompute, at = map(int, found.groups())
    assert forward == recompute and at == forward - 1  # the last op: exp vs add
    assert "clone" not in message and "detach" not in message


@pytest.mark.parametrize(
    ("switch", "keyword", "runs"),
    [
        (False, True, 2),
        pytest.param(
            True,
            False,
            1,
            marks=pytest.mark.skipif(
                _options._TORCH_EARLY_STOP_DEFAULT is True,
                reason="this torch's switch holds True by default: a switch set "
                "to True cannot be told from it (see the test below)",
            ),
        ),
    ],
)
def test_torch_early_stop_switch_wins_over_the_keyword(
    switch: bool, keyword: bool, runs: int
) -> None:
    # torch.utils.checkpoint.set_checkpoint_early_stop overrides the keyword,
    # for checkpoints whose forward ran under it, also when their backward
    # runs after the context manager is left (as torch's own tests pin down).
    tail = CountsFinished()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), tail)
    with tc.set_checkpoint_early_stop(switch):
        y = checkpoint(model, torch.randn(3, 4, requires_grad=True), early_stop=keyword)
    y.sum().backward()
    assert tail.finished == runs


def test_older_torchs_default_early_stop_leaves_the_keyword_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch 2.8 (and older) holds True in the switch when nobody set it: that
    # must not override early_stop=False; a switch set to False still wins.
    monkeypatch.setattr(tc, "_enable_checkpoint_early_stop", True)
    monkeypatch.setattr(_options, "_TORCH_EARLY_STOP_DEFAULT", True)
    tail = CountsFinished()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), tail)
    x = torch.randn(3, 4, requires_grad=True)
    checkpoint(model, x, early_stop=False).sum().backward()
    assert tail.finished == 2
    with tc.set_checkpoint_early_stop(False):
        y = checkpoint(model, x)
    y.sum().backward()
    assert tail.finished == 2 + 2


def test_torch_early_stop_switch_reaches_checkpoint_sequential() -> None:
    tail = CountsFinished()
    model = nn.Sequential(nn.Linear(4, 4), tail, nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    checkpoint_sequential(model, 2, x).sum().backward()
    assert tail.finished == 1  # the first segment's recompute stops in its matmul
    with tc.set_checkpoint_early_stop(False):
        y = checkpoint_sequential(model, 2, x)
    y.sum().backward()
    assert tail.finished == 1 + 2


def test_torch_debug_switch_turns_debug_on() -> None:
    state = {"flip": False}

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.cos() if state["flip"] else x.exp().sin()).sum()

    with tc.set_checkpoint_debug_enabled(True):
        y = checkpoint(f, torch.randn(3, requires_grad=True))
    state["flip"] = True
    with pytest.raises(CheckpointError, match=r"first differ at op #0") as info:
        y.backward()
    # torch's words for it, too
    assert "You are seeing this error because you passed `debug=True`" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("mode", "early_stop", "words"),
    [
        ("fewer", True, "A different number of tensors was saved"),
        ("more", False, "trying to save more tensors during recomputation"),
        (
            "shape",
            True,
            "Recomputed values for the following tensors have different metadata",
        ),
    ],
)
def test_errors_carry_the_words_of_torchs(
    mode: str, early_stop: bool, words: str
) -> None:
    # Code and tests written against torch's checkpoint match on its messages.
    from tests.test_checkpoint import Flip

    f = Flip(mode)
    with tc.set_checkpoint_early_stop(early_stop):
        y = checkpoint(f, torch.randn(3, 2, requires_grad=True))
    f.flip = True
    with pytest.raises(tc.CheckpointError, match=f"^seqckpt: .*{words}"):
        y.sum().backward()


def _torchs(reentrant: bool) -> Callable[..., Any]:
    return functools.partial(tc.checkpoint, use_reentrant=reentrant)


@pytest.mark.parametrize(
    ("inner", "outer"),
    [
        (checkpoint, _torchs(False)),
        (checkpoint, _torchs(True)),
        (_torchs(False), checkpoint),
        (_torchs(True), checkpoint),
        (_torchs(False), lambda m, x: checkpoint_sequential(m, 2, x)),
    ],
    ids=["in-torch", "in-torch-reentrant", "around-torch", "around-reentrant", "seq"],
)
def test_nested_with_torchs_checkpoint_either_way(inner: Any, outer: Any) -> None:
    """seqckpt inside torch's checkpoint (a wrapper a trainer applies around a
    model that checkpoints its blocks) and torch's inside seqckpt's (layers
    with their own checkpointing in a seqckpt chain): the plain run's
    gradients and dropout masks, bitwise."""

    def body() -> nn.Module:
        return nn.Sequential(
            nn.Linear(8, 8), nn.LayerNorm(8), nn.Dropout(0.2), nn.GELU()
        )

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(Residual(body(), inner) for _ in range(4)))

    def plain(model: nn.Module, x: torch.Tensor) -> Any:
        for block in model:
            block.checkpoint = None  # the body called directly
        return model(x)

    assert_matches_plain(
        build, torch.randn(6, 8, requires_grad=True), outer, plain=plain
    )


def test_an_input_modified_in_place_raises_with_torchs_words() -> None:
    """torch's checkpoint raises the engine's "modified by an inplace
    operation" error; ours is a CheckpointError (a RuntimeError) with the same
    words and both versions."""
    words = (
        "one of the variables needed for gradient computation has been "
        "modified by an inplace operation"
    )
    for run in (
        lambda f, t: tc.checkpoint(f, t, use_reentrant=False),
        lambda f, t: checkpoint(f, t),
    ):
        x = torch.randn(3, requires_grad=True)
        h = x * 1
        y = run(torch.sin, h)
        h.mul_(2)
        with pytest.raises(RuntimeError, match=words) as raised:
            y.sum().backward()
    assert isinstance(raised.value, tc.CheckpointError)
    assert "at version 1; expected version 0" in str(raised.value)


class ClipsItsWeight(nn.Module):
    """Clamps its own weight in place in every forward (a max-norm style
    constraint), then uses it: a recompute changes the parameter again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.3, 0.3)
        return self.lin(x).tanh()


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_parameter_changed_in_place_by_the_function_itself_is_fine(
    nested: bool,
) -> None:
    # The plain run saves the clamped weight and backward finds it unchanged;
    # a recompute clamps it once more (same values, a newer version), also
    # the recompute of an outer region that reruns an inner one.
    torch.manual_seed(0)
    model = nn.Sequential(ClipsItsWeight(), nn.GELU(), ClipsItsWeight())

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not nested:
            return checkpoint(m, x)
        return checkpoint(lambda t: m[2](m[1](checkpoint(m[0], t))), x)

    assert_matches_plain(model, torch.randn(3, 4, requires_grad=True), run)


def test_checkpoint_error_is_torchs_checkpoint_error() -> None:
    state = {"flip": False}

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x[:2] if state["flip"] else x).exp()

    y = checkpoint(f, torch.randn(3, requires_grad=True))
    state["flip"] = True
    with pytest.raises(tc.CheckpointError, match="seqckpt: saved tensor #0"):
        y.sum().backward()


def test_context_fn_wraps_the_forward_and_each_recompute() -> None:
    modes: list[OpCounter] = []

    def context_fn() -> tuple[OpCounter, OpCounter]:
        modes[:] = [OpCounter(), OpCounter()]
        return modes[0], modes[1]

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(lambda t: t.exp().sin(), x, context_fn=context_fn)
    forward, recompute = modes
    assert forward.counts.get("exp") == 1 and not recompute.counts
    y.sum().backward()
    assert recompute.counts.get("exp") == 1


def test_torch_selective_checkpoint_policy_works_unchanged() -> None:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    a, b = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)

    def block(x: torch.Tensor) -> torch.Tensor:
        return b(a(x).relu()).sin()

    x = torch.randn(8, 16, requires_grad=True)
    keep_mm = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])

    def mm_in_backward(**options: Any) -> int:
        y = checkpoint(block, x, **options)
        with OpCounter() as counter:
            y.sum().backward()
        return counter.counts.get("mm", 0)

    plain_count = mm_in_backward()
    selective_count = mm_in_backward(context_fn=keep_mm)
    # Without a policy both matmuls run again in the recompute; with it they
    # are served from what the forward kept.
    assert plain_count - selective_count == 2
    assert_matches_plain(
        nn.ModuleList([a, b]),
        x,
        lambda m, t: checkpoint(
            lambda u: m[1](m[0](u).relu()).sin(), t, context_fn=keep_mm
        ),
        plain=lambda m, t: m[1](m[0](t).relu()).sin(),
    )


# ------------------------------------------------- a backward inside the region


def test_autograd_grad_inside_the_function() -> None:
    def h(x: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(x.exp().sum(), x, create_graph=True)
        return x.sin() * g

    x = torch.tensor([0.5, 1.0], requires_grad=True)
    checkpoint(h, x).sum().backward()
    got = x.grad
    x.grad = None
    h(x).sum().backward()
    assert torch.equal(got, x.grad)


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def _grad(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x: torch.autograd.grad(fn(x), x, create_graph=True)[0]


def _sum(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x: fn(x).sum()


def _c(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x: checkpoint(fn, x)


def _plain(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    return fn


# Compositions of checkpoint (c), grad and sum as TestNestedCheckpoint builds them.
NESTINGS = [
    "s(c(f))",
    "c(s(c(f)))",
    "c(c(c(s(f))))",
    "s(c(g(s(c(f)))))",
    "c(s(g(c(s(f)))))",
    "s(g(c(s(g(c(s(f)))))))",
    "c(s(c(g(s(c(g(s(c(f)))))))))",
    "g(c(s(g(c(s(c(f)))))))",
]


@pytest.mark.parametrize("expression", NESTINGS)
def test_nested_checkpoints_and_grads_match_plain(expression: str) -> None:
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    names = {"s": _sum, "g": _grad, "f": _f}
    got = eval(expression, {**names, "c": _c})(x)
    ref = eval(expression, {**names, "c": _plain})(x)
    assert torch.equal(got, ref)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    assert torch.equal(got_grad, ref_grad)


def test_an_optimizer_step_fused_into_backward_is_fine() -> None:
    # torch's "optimizer in backward" pattern: each parameter is stepped by a
    # hook as soon as its gradient is accumulated. Here the Linear's branch
    # finishes (and its weight is stepped) before the other branch needs the
    # region's recompute: the plain run passes, so must seqckpt, bitwise.
    def train(run: Callable[..., Any]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        for p in lin.parameters():
            step = torch.optim.SGD([p], lr=0.1)

            def hook(p: torch.Tensor, step: torch.optim.Optimizer = step) -> None:
                step.step()
                step.zero_grad()

            p.register_post_accumulate_grad_hook(hook)
        x = torch.randn(3, 4, requires_grad=True)
        a, b = run(lambda t: (t.exp().sin(), lin(t)), x)
        (a.sum() + b.sum()).backward()
        return [x.grad, *(p.detach() for p in lin.parameters())]

    for got, ref in zip(train(checkpoint), train(lambda f, x: f(x)), strict=True):
        assert torch.equal(got, ref)


def _graph_nodes(root: Any) -> list[Any]:
    seen, todo = [root], [root]
    while todo:
        for child, _ in todo.pop().next_functions:
            if child is not None and all(child is not s for s in seen):
                seen.append(child)
                todo.append(child)
    return seen


class _Probe:
    """Hung on a graph node's metadata: alive exactly as long as the node."""


@pytest.mark.parametrize(
    "options",
    [{}, {"early_stop": False}, {"policy": lambda op, *args, **kwargs: True}],
    ids=["default", "no early stop", "policy keeping everything"],
)
@pytest.mark.parametrize("expression", NESTINGS)
def test_nested_graphs_die_with_their_outputs(
    expression: str, options: dict[str, Any]
) -> None:
    # TestNestedCheckpoint.check_graph_dies: once the result is dropped, every
    # node of its graph and the leaf input are freed by reference counting.
    # (A recompute under create_graph used to hand back its tensors with the
    # recompute's own graph attached; from second-order gradients on, that
    # kept the leaf alive even after gc.collect().)
    def c(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda x: checkpoint(fn, x, **options)

    fn = eval(expression, {"s": _sum, "g": _grad, "f": _f, "c": c})
    plain = eval(expression, {"s": _sum, "g": _grad, "f": _f, "c": _plain})
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.equal(fn(x), plain(x))

    def scope() -> list[weakref.ref[Any]]:
        leaf = torch.randn(5, dtype=torch.float64, requires_grad=True)
        out = fn(leaf)
        return [weakref.ref(leaf)] + [
            weakref.ref(node.metadata.setdefault("probe", _Probe()))
            for node in _graph_nodes(out.grad_fn)
        ]

    gc.disable()
    try:
        refs = scope()
        assert len(refs) > 2  # the probes reached the graph
        assert [ref for ref in refs if ref() is not None] == []
    finally:
        gc.enable()


def test_nested_two_children_and_non_tensor_arguments() -> None:
    def child(x: torch.Tensor, scale: float, tag: str) -> tuple[torch.Tensor, str]:
        return x.sin() * scale, tag

    def parent(x: torch.Tensor) -> torch.Tensor:
        a, tag_a = checkpoint(child, x, 2.0, tag="a")
        b, tag_b = checkpoint(child, x.cos(), scale=3.0, tag="b")
        assert (tag_a, tag_b) == ("a", "b")
        return (a * b).sum()

    x = torch.randn(4, requires_grad=True)
    (got,) = torch.autograd.grad(checkpoint(parent, x), x)
    (ref,) = torch.autograd.grad(parent(x), x)
    assert torch.equal(got, ref)


# ------------------------------------------------------- saved tensors


class SavesTwo(torch.autograd.Function):
    """Saves a grad-requiring and a non-grad input; records what backward gets."""

    seen: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        a, b = ctx.saved_tensors
        SavesTwo.seen = [a, b]
        return grad * b, None


def test_a_saved_tensor_without_grad_comes_back_as_the_same_object() -> None:
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    b.note = "kept"  # type: ignore[attr-defined]
    checkpoint(SavesTwo.apply, a, b).sum().backward()
    assert SavesTwo.seen[1] is b and SavesTwo.seen[1].note == "kept"  # type: ignore[attr-defined]
    assert torch.equal(a.grad, b)


def test_saved_tensors_read_twice_in_one_backward() -> None:
    # Deliberate difference: torch raises on a second unpack of the same saved
    # tensor within one backward; seqckpt recomputes the region again.
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (first,) = ctx.saved_tensors
            (second,) = ctx.saved_tensors
            return grad * (first + second) / 2

    x = torch.randn(4, requires_grad=True)
    checkpoint(lambda t: ReadsTwice.apply(t * 2), x).sum().backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).exp())


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "in GraphExecGroup"])
def test_two_backward_calls_over_one_region_share_its_recompute(grouped: bool) -> None:
    # TestAutograd.test_checkpoint_graph_execution_group. Deliberate difference:
    # torch recomputes a region once per backward call unless the calls run
    # inside its GraphExecGroup (three runs of the function here, two inside
    # one). seqckpt's recompute keeps what a first call did not use for the
    # next one, as the plain run keeps it in the graph: two runs either way.
    if grouped and not hasattr(tc, "GraphExecGroup"):
        pytest.skip("this torch has no GraphExecGroup")
    runs = [0]

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        runs[0] += 1
        y = x.sin().cos()
        return y, y.sin().cos()

    def grads(
        f: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        x = torch.linspace(-1, 1, 9, requires_grad=True)
        y, z = f(x)
        with tc.GraphExecGroup() if grouped else contextlib.nullcontext():
            (gy,) = torch.autograd.grad(z, y, torch.ones_like(z))
            (gx,) = torch.autograd.grad(y, x, gy)
        return gx

    got = grads(lambda x: checkpoint(fn, x))
    assert runs == [2]
    assert torch.equal(got, grads(fn))


def test_saved_tensor_accessed_from_python_before_backward() -> None:
    def foo(a: torch.Tensor) -> torch.Tensor:
        return torch.exp(a * a)

    a = torch.randn(5, requires_grad=True)
    d = checkpoint(foo, a)
    first = d.grad_fn._saved_result  # type: ignore[union-attr]
    second = d.grad_fn._saved_result  # type: ignore[union-attr]
    assert torch.equal(first, second) and torch.equal(first, d)
    d.sum().backward()
    assert torch.equal(a.grad, 2 * a.detach() * d.detach())


def test_saved_tensors_are_freed_as_backward_uses_them() -> None:
    # TestCheckpoint.test_checkpointing_without_reentrant_early_free, on the CPU:
    # at each step of the backward the live bytes go down, also with
    # retain_graph=True, exactly as in the plain run.
    def run(
        step: Callable[[Callable[[torch.Tensor], torch.Tensor]], None],
    ) -> list[int]:
        live: list[int] = []
        with track_memory("cpu") as mem:

            def fn(x: torch.Tensor) -> torch.Tensor:
                for i in range(4):  # a chain of ops that each save their input
                    x = x**2
                    if i < 3:
                        x.register_hook(lambda g: live.append(mem.live_bytes()))
                return x.sum()

            step(fn)
        return live

    x = torch.zeros(4096, requires_grad=True)
    x.grad = torch.zeros_like(x)
    plain = run(lambda fn: fn(x).backward())
    assert len(plain) == 3 and plain[0] > plain[1] > plain[2]
    assert run(lambda fn: checkpoint(fn, x).backward()) == plain
    # With retain_graph the plain run keeps everything; a checkpoint still frees.
    assert run(lambda fn: checkpoint(fn, x).backward(retain_graph=True)) == plain
    assert run(lambda fn: fn(x).backward(retain_graph=True))[2] > plain[2]


def test_a_saved_tensor_whose_graph_died_in_forward_is_not_held() -> None:
    # An op saves a tensor inside the region, but its graph is gone before
    # backward: the result was detached (PEFT's DoRA computes its weight norm
    # from a detached LoRA product, so the matmuls' saved inputs die with it).
    # The recompute must not hold what no backward node will ask for: torch's
    # checkpoint drops it (its holders are weakly referenced), and so does
    # the plain run, where the graph that saved it is freed at once.
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        side = w.exp()  # exp saves its output: a graph that dies just below
        scale = side.detach().mean()
        return (x * scale).sin()

    def backward_peak(
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> int:
        x = torch.randn(256, 256, requires_grad=True)
        w = torch.randn(256, 256, requires_grad=True)
        out = step(x, w)
        with track_memory("cpu") as mem:
            out.sum().backward()
        return mem.peak_bytes

    ours = backward_peak(lambda x, w: checkpoint(fn, x, w))
    torchs = backward_peak(lambda x, w: tc.checkpoint(fn, x, w, use_reentrant=False))
    assert ours <= torchs, (ours, torchs)
    # ... also where the recompute runs to its end, and where it fingerprints
    # each tensor (the fingerprints, a few bytes each, are all it adds)
    assert backward_peak(lambda x, w: checkpoint(fn, x, w, early_stop=False)) <= torchs
    dead = 256 * 256 * 4  # the bytes of exp's output
    values = backward_peak(
        lambda x, w: checkpoint(fn, x, w, determinism_check="values")
    )
    assert values < torchs + dead // 64, (values, torchs)


# --------------------------------------------- TestCheckpoint's behaviours


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter += 1
        return x * torch.tensor(2.0)


def test_checkpoint_sequential_recomputes_all_but_the_last_segment() -> None:
    modules = [Net() for _ in range(10)]
    out = checkpoint_sequential(modules, 2, torch.randn(3, 4, requires_grad=True))
    assert [m.counter for m in modules] == [1] * 10
    out.sum().backward()
    assert [m.counter for m in modules] == [2] * 5 + [1] * 5


def test_checkpoint_sequential_with_autograd_grad_create_graph() -> None:
    model = nn.Sequential(
        nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5)
    )
    x = torch.randn(1, 100, requires_grad=True)
    ones = torch.ones(1, 5)
    ref = torch.autograd.grad([model(x)], [x], [ones], create_graph=True)
    out = checkpoint_sequential(list(model.children()), 2, x)
    assert torch.equal(out, model(x))
    got = torch.autograd.grad([out], [x], [ones], create_graph=True)
    assert torch.equal(got[0], ref[0]) and got[0].requires_grad


def test_checkpoint_sequential_takes_torchs_argument_names_and_places() -> None:
    """As torch's: the chain passed as ``functions=``, and ``use_reentrant``
    as a fourth positional argument (both found at real call sites)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    for call in (
        lambda: checkpoint_sequential(functions=model, segments=2, input=x),
        lambda: checkpoint_sequential(model, 2, x, False),
        lambda: checkpoint_sequential(model, 2, x, True, preserve_rng_state=False),
    ):
        assert torch.equal(call(), model(x))
    with pytest.raises(TypeError, match="use_reentrant"):
        checkpoint_sequential(model, 2, x, "yes")  # type: ignore[arg-type]


def test_flop_counter_and_fake_tensors_see_what_torchs_checkpoint_shows() -> None:
    """Tools that run a step under a dispatch mode: ``FlopCounterMode`` counts
    the recompute as for torch's checkpoint (more than the plain step), and a
    step on ``FakeTensorMode`` tensors (memory estimators) runs through."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh())

    def flops(call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> int:
        torch.manual_seed(0)
        model, x = block(), torch.randn(4, 8, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            call(model, x).sum().backward()
        return int(counter.get_total_flops())

    torchs = flops(lambda m, x: tc.checkpoint(m, x, use_reentrant=False))
    assert flops(checkpoint) == torchs > flops(lambda m, x: m(x))
    with FakeTensorMode():
        model, x = block(), torch.randn(4, 8, requires_grad=True)
        checkpoint(model, x).sum().backward()
    assert x.grad is not None and type(x.grad).__name__ == "FakeTensor"


def test_checkpoint_sequential_takes_one_input() -> None:
    # torch raises TypeError (the second tensor lands in use_reentrant); seqckpt
    # says so, and how to pass two inputs, instead of printing the tensor
    with pytest.raises(TypeError, match=r"takes one input.*\(a, b\)"):
        checkpoint_sequential(
            nn.Sequential(nn.Identity()), 1, torch.ones(1), torch.ones(1)
        )  # type: ignore[arg-type]


def test_non_tensor_inputs_and_outputs_and_an_input_returned() -> None:
    def foo(
        t1: torch.Tensor, t2: torch.Tensor, scale: int, t3: torch.Tensor
    ) -> tuple[Any, ...]:
        t4 = t1 + t2 * t3
        t5 = t1 * t2 + t3
        t4 *= scale
        t5 *= scale
        return scale, t4, None, True, t5, "bar", t1

    t1 = torch.rand(10, requires_grad=True)
    t2 = torch.rand(10, requires_grad=True)
    t3 = torch.rand(10)
    res = checkpoint(foo, t1, t2, 3, t3)
    ref = foo(t1, t2, 3, t3)
    assert (res[0], res[2], res[3], res[5]) == (3, None, True, "bar")
    assert torch.equal(res[1], ref[1]) and torch.equal(res[4], ref[4])
    assert torch.equal(res[6], t1)
    torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    got = (t1.grad, t2.grad)
    t1.grad = t2.grad = None
    torch.autograd.backward([ref[1].sum(), ref[4].sum(), ref[6].sum()])
    assert torch.equal(got[0], t1.grad) and torch.equal(got[1], t2.grad)


def test_no_tensors_at_all() -> None:
    assert checkpoint(lambda a, b: (a + b, "x"), 1.5, 2.0) == (3.5, "x")
    assert (
        checkpoint(lambda t, none: t if none is None else 0, torch.ones(2), None).sum()
        == 2
    )


def test_outputs_that_do_not_require_grad() -> None:
    def run(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.exp(), b * 2

    a = torch.randn(4, requires_grad=True)
    out, other = checkpoint(run, a, torch.randn(4))
    assert not other.requires_grad
    out.sum().backward()
    assert torch.equal(a.grad, a.detach().exp())


def test_a_failed_recompute_leaves_the_next_checkpoint_working() -> None:
    state = {"shape": 3}

    def f(x: torch.Tensor) -> torch.Tensor:
        return x[: state["shape"]].exp().sum()

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(f, x)
    state["shape"] = 2
    with pytest.raises(CheckpointError, match="shape"):
        y.backward()
    assert not seqckpt.is_recomputing()
    state["shape"] = 3
    x.grad = None
    checkpoint(f, x).backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_inside_other_saved_tensor_hooks() -> None:
    # torch.autograd.graph.save_on_cpu and similar hooks around a checkpoint.
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    x = torch.randn(3, 6, requires_grad=True)

    def under_hooks(m: nn.Module, t: torch.Tensor, use: bool) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return checkpoint(m, t) if use else m(t)

    assert_matches_plain(
        model,
        x,
        lambda m, t: under_hooks(m, t, True),
        plain=lambda m, t: under_hooks(m, t, False),
    )


def test_a_failing_context_fn_leaves_nothing_behind() -> None:
    from torch.nn.modules import module as nn_module

    hooks = len(nn_module._global_forward_pre_hooks)

    def broken() -> tuple[Any, Any]:
        raise RuntimeError("broken context_fn")

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="broken context_fn") as info:
        # "values" watches every module call with a global hook, entered first
        checkpoint(nn.Linear(4, 4), x, context_fn=broken, determinism_check="values")
    # (while the error and its frames are alive, as in a caller handling it)
    assert info.traceback is not None
    assert len(nn_module._global_forward_pre_hooks) == hooks
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize(
    "returned", [None, contextlib.nullcontext(), (contextlib.nullcontext(),)]
)
def test_a_context_fn_returning_other_than_two_contexts_is_named(
    returned: Any,
) -> None:
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError, match="context_fn must return two context"):
        checkpoint(nn.Linear(4, 4), x, context_fn=lambda: returned)
    assert not seqckpt.is_checkpointing()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# ------------------------------------------------------------ torch.func


def _tanh_mlp(t: torch.Tensor) -> torch.Tensor:
    return torch.tanh(t @ t.T).exp().sum(dim=0)


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap_of_grad"])
def test_under_torch_func_gradients_it_runs_plain_and_says_so(transform: str) -> None:
    # torch.func's reverse-mode transforms refuse saved-tensor hooks; torch's
    # checkpoint raises there. seqckpt runs the function plainly and warns.
    x = torch.randn(3, 4)

    def transformed(f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if transform == "grad":
            return torch.func.grad(lambda t: f(t).sum())(x)
        if transform == "jacrev":
            return torch.func.jacrev(f)(x)
        return torch.vmap(torch.func.grad(lambda t: f(t.unsqueeze(0)).sum()))(x)

    # (torch 2.8 fails earlier under vmap(grad): no vmap rule for its own
    # autograd Function)
    with pytest.raises(RuntimeError, match="saved tensor hooks|vmap support"):
        transformed(lambda t: tc.checkpoint(_tanh_mlp, t, use_reentrant=False))
    with pytest.warns(UserWarning, match="seqckpt: _tanh_mlp runs without check"):
        ours = transformed(lambda t: checkpoint(_tanh_mlp, t))
    assert torch.equal(ours, transformed(_tanh_mlp))
    # and the hooks are usable again afterwards: a normal call checkpoints
    counter = OpCounter()
    with counter:
        checkpoint(_tanh_mlp, torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert counter.counts["tanh"] == 2  # the forward and the recompute


def test_under_vmap_or_jvp_without_gradients_it_runs_plain_silently() -> None:
    x = torch.randn(5, 3, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="seqckpt")
        ours = torch.vmap(lambda t: checkpoint(_tanh_mlp, t))(x)
        dual = torch.func.jvp(lambda t: checkpoint(_tanh_mlp, t), (x[0],), (x[1],))
    assert torch.equal(ours, torch.vmap(_tanh_mlp)(x))
    plain = torch.func.jvp(_tanh_mlp, (x[0],), (x[1],))
    assert all(torch.equal(a, b) for a, b in zip(dual, plain, strict=True))


@pytest.mark.parametrize("transform", ["vmap", "jvp", "ensemble"])
def test_under_vmap_or_jvp_with_a_later_backward_it_runs_plain_and_says_so(
    transform: str,
) -> None:
    # The backward of a forward run under vmap or jvp comes after the
    # transform has ended, where the region cannot run again: torch's
    # checkpoint fails there (an escaped batched tensor, or a different count
    # of saved tensors). seqckpt runs the region plainly and warns.
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)]
    x = torch.randn(3, 5, 4, requires_grad=True)

    def grads(model: nn.Module) -> list[torch.Tensor]:
        if transform == "ensemble":  # torch.func's model ensembling
            params, buffers = torch.func.stack_module_state([model, model])
            out = torch.vmap(
                lambda p, b, t: torch.func.functional_call(model, (p, b), (t,)),
                in_dims=(0, 0, None),
            )(params, buffers, x)
            out.square().sum().backward()
            return [x.grad, *(p.grad for p in params.values())]  # type: ignore[misc]
        if transform == "vmap":
            out = torch.vmap(model)(x)
        else:
            out, tangent = torch.func.jvp(model, (x,), (torch.ones_like(x),))
            out = out + tangent
        out.square().sum().backward()
        return [x.grad, *(p.grad for p in model.parameters())]  # type: ignore[misc]

    plain = grads(nn.Sequential(*layers))
    x.grad = None
    for p in nn.Sequential(*layers).parameters():
        p.grad = None
    label = "torch.vmap" if transform != "jvp" else "torch.func.jvp"
    with pytest.warns(UserWarning, match=f"runs without checkpointing under {label}"):
        ours = grads(seqckpt.CheckpointedSequential(*layers, segments=2))
    assert all(torch.equal(a, b) for a, b in zip(ours, plain, strict=True))


# ------------------------------------------------ torch.func.functional_call


class CheckpointsItsBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x)


@pytest.mark.parametrize("stand_ins", ["leaves", "updated"])
@pytest.mark.parametrize("where", ["inside_forward", "checkpointed_sequential"])
def test_functional_call_recomputes_with_the_tensors_it_was_given(
    stand_ins: str, where: str
) -> None:
    # functional_call puts other tensors in the parameter slots for the call
    # and the module's own parameters back before backward; the recompute must
    # use the tensors of the call (torch's checkpoint uses the module's own:
    # its gradients differ from the plain run's without an error).
    torch.manual_seed(0)
    model: nn.Module = CheckpointsItsBody()
    if where == "checkpointed_sequential":
        model = seqckpt.CheckpointedSequential(*model.body, segments=2)  # type: ignore[arg-type]
    plain_model = model.body if where == "inside_forward" else nn.Sequential(*model)  # type: ignore[arg-type]
    x = torch.randn(3, 4)
    leaves = {k: (2 * v.detach()).requires_grad_() for k, v in model.named_parameters()}

    def grads(m: nn.Module, prefix: str) -> tuple[torch.Tensor, ...]:
        given = {
            k[len(prefix) :]: (v - 0.01 if stand_ins == "updated" else v)  # MAML
            for k, v in leaves.items()
        }
        torch.manual_seed(1)
        out = torch.func.functional_call(m, given, (x,))
        return torch.autograd.grad(out.sum(), list(leaves.values()))

    ours = grads(model, "")
    plain = grads(plain_model, "body." if where == "inside_forward" else "")
    assert all(torch.equal(a, b) for a, b in zip(ours, plain, strict=True))
    assert all(type(p) is nn.Parameter for p in model.parameters())  # its own again


def test_an_inference_tensor_input_behaves_as_in_the_plain_run() -> None:
    # An inference tensor has no version counter (reading it raised). One that
    # no op saves works as in the plain run (torch's checkpoint raises: it
    # saves its inputs); one that an op saves raises the plain run's error;
    # an in-place change of another input is still named.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    with torch.inference_mode():
        frozen = torch.randn(3, 4)

    def f(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (t + lin(u)).sin()  # the add saves nothing of t

    def grads(call: Callable[..., torch.Tensor]) -> list[torch.Tensor | None]:
        lin.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        call(f, frozen, x).sum().backward()
        return [x.grad, *(p.grad for p in lin.parameters())]

    plain = grads(lambda g, *a: g(*a))
    assert all(
        torch.equal(a, b)  # type: ignore[arg-type]
        for a, b in zip(grads(checkpoint), plain, strict=True)
    )
    moved = torch.randn(3, 4, requires_grad=True) * 1
    y = checkpoint(f, frozen, moved)
    moved.add_(1)
    with pytest.raises(CheckpointError, match="input tensor #1"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
        checkpoint(lambda t: lin(t).sin(), frozen)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
        lin(frozen).sin()


class ScaledBy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sin()


class Checkpoints(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_functional_call_buffers_are_the_ones_recomputed_with(mode: str) -> None:
    # torch.func.functional_call(model, (parameters, buffers), x) puts the
    # given buffers in the buffer slots for the call only: the recompute must
    # use them (it used the module's own: other gradients, no error), and a
    # batch norm in training updates the given statistics once.
    torch.manual_seed(0)
    body = nn.Sequential(
        nn.Linear(4, 4), ScaledBy(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()
    ).train(mode == "train")
    own = [b.clone() for b in body.buffers()]
    x = torch.randn(3, 4)

    def step(model: nn.Module, prefix: str) -> tuple[list[torch.Tensor], ...]:
        params = {k: v.detach().requires_grad_() for k, v in body.named_parameters()}
        buffers = {
            "1.scale": torch.full((4,), 3.0),
            "3.running_mean": torch.linspace(-1.0, 1.0, 4),
            "3.running_var": torch.linspace(0.5, 2.0, 4),
            "3.num_batches_tracked": torch.tensor(0),
        }
        given = (
            {prefix + k: v for k, v in params.items()},
            {prefix + k: v for k, v in buffers.items()},
        )
        out = torch.func.functional_call(model, given, (x,))
        grads = torch.autograd.grad(out.sum(), list(params.values()))
        return list(grads), list(buffers.values())

    ours = step(Checkpoints(body), "body.")
    plain = step(body, "")
    for a, b in zip(ours, plain, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(body.buffers(), own, strict=True))


def test_debug_says_when_both_runs_ran_the_same_ops() -> None:
    """A values difference ("values" check) with identical op logs: the message
    said the logs "first differ at op #N", N being their length."""
    state = {"scale": 1.0}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * state["scale"]).sin()

    x = torch.randn(4, requires_grad=True)
    y = seqckpt.checkpoint(fn, x, determinism_check="values", debug=True)
    state["scale"] = 2.0  # the recompute computes other values with the same ops
    with pytest.raises(CheckpointError, match="ran the same 2 ops") as info:
        y.sum().backward()
    assert "first differ" not in str(info.value)
