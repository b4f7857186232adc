"""seqckpt.replace_torch_checkpoint: code that calls torch's checkpoint
functions through the module (as timm and torchvision do) runs seqckpt's."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import seqckpt
from seqckpt import replace_torch_checkpoint
from seqckpt.checkpoint import TORCH_CHECKPOINT, TORCH_CHECKPOINT_SEQUENTIAL
from tests.counting import OpCounter
from tests.oracle import assert_matches_plain


def dropout_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.BatchNorm1d(8))
            for _ in range(4)
        ]
    )


class SeesCheckpointing(nn.Module):
    """Records, on each call, whether it runs inside a seqckpt region."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(seqckpt.is_checkpointing() or seqckpt.is_recomputing())
        return x.sin().cos()  # cos saves sin's output: recomputed


def library_every_block(model: nn.Module, x: torch.Tensor) -> Any:
    """A stand-in for library code (timm's checkpoint helper): looks the
    function up on the module at call time."""
    for block in model:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return x


def library_sequential(model: nn.Module, x: torch.Tensor) -> Any:
    return torch.utils.checkpoint.checkpoint_sequential(
        model, 2, x, use_reentrant=False
    )


def library_sequential_torchs_forms(model: nn.Module, x: torch.Tensor) -> Any:
    """torch's other call forms: the chain as ``functions=``, and
    ``use_reentrant`` as a fourth positional argument."""
    y = torch.utils.checkpoint.checkpoint_sequential(
        functions=model[:2], segments=2, input=x, use_reentrant=False
    )
    return torch.utils.checkpoint.checkpoint_sequential(model[2:], 1, y, False)


def seqckpts_inside() -> bool:
    """torch's names run seqckpt's functions (wrapped to add a block's options)."""
    module = torch.utils.checkpoint
    return (
        getattr(module.checkpoint, "__wrapped__", None) is seqckpt.checkpoint
        and getattr(module.checkpoint_sequential, "__wrapped__", None)
        is seqckpt.checkpoint_sequential
    )


def test_the_functions_are_swapped_inside_and_given_back() -> None:
    with replace_torch_checkpoint():
        assert seqckpts_inside()
        with replace_torch_checkpoint():  # nested
            pass
        assert seqckpts_inside()
    assert torch.utils.checkpoint.checkpoint is TORCH_CHECKPOINT
    assert torch.utils.checkpoint.checkpoint_sequential is TORCH_CHECKPOINT_SEQUENTIAL
    with pytest.raises(ValueError, match="inside"), replace_torch_checkpoint():
        raise ValueError("inside")
    assert torch.utils.checkpoint.checkpoint is TORCH_CHECKPOINT


def test_blocks_open_in_two_threads_give_torchs_back_when_the_last_ends() -> None:
    # first opens, second opens, first ends, second ends: a block that put back
    # what it saw on entry would leave seqckpt's in place for good
    first_open, second_open, first_closed = (threading.Event() for _ in range(3))
    seen_in_second: list[bool] = []

    def first() -> None:
        with replace_torch_checkpoint():
            first_open.set()
            second_open.wait(10)
        first_closed.set()

    def second() -> None:
        first_open.wait(10)
        with replace_torch_checkpoint():
            second_open.set()
            first_closed.wait(10)
            seen_in_second.append(seqckpts_inside())

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert first_closed.is_set() and second_open.is_set()
    assert seen_in_second == [True]  # still seqckpt's after the first block ended
    assert torch.utils.checkpoint.checkpoint is TORCH_CHECKPOINT
    assert torch.utils.checkpoint.checkpoint_sequential is TORCH_CHECKPOINT_SEQUENTIAL


@pytest.mark.parametrize(
    "library",
    [library_every_block, library_sequential, library_sequential_torchs_forms],
)
def test_library_calls_run_seqckpt_and_match_the_plain_run(library: Any) -> None:
    probe = SeesCheckpointing()
    model = nn.Sequential(probe, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    with replace_torch_checkpoint():
        library(model, torch.randn(3, 8, requires_grad=True)).sum().backward()
    assert probe.seen == [True, True]  # first run and recompute, both seqckpt's
    probe.seen.clear()
    library(model, torch.randn(3, 8, requires_grad=True)).sum().backward()
    assert probe.seen == [False, False]  # torch's again after the block

    def under_replacement(m: nn.Module, x: torch.Tensor) -> Any:
        with replace_torch_checkpoint():
            return library(m, x)

    # dropout masks and BatchNorm statistics as in the plain run, bitwise
    assert_matches_plain(
        dropout_chain(), torch.randn(5, 8, requires_grad=True), under_replacement
    )


def test_compiled_code_still_gets_torchs_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under torch.compile seqckpt hands the call to torch's checkpoint; with
    # torch's name pointing at seqckpt's that must not loop back. (Compiling
    # is slow on a CPU: pretend to compile, which runs torch's in eager mode.)
    calls: list[int] = []

    def torch_checkpoint_counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return TORCH_CHECKPOINT(*args, **kwargs)

    module = sys.modules["seqckpt.checkpoint"]  # (the package exports a function
    # of the same name)
    monkeypatch.setattr(module, "TORCH_CHECKPOINT", torch_checkpoint_counted)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    with replace_torch_checkpoint():  # opened outside the compiled code
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        library_every_block(model, torch.randn(2, 8, requires_grad=True))
        monkeypatch.undo()
    assert calls == [1, 1]


def test_a_block_opened_inside_compiled_code_keeps_the_graph_whole() -> None:
    # A lock cannot be traced: inside compiled code the block does nothing
    # (seqckpt's checkpoint would hand the call to torch's there anyway).
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(t: torch.Tensor) -> torch.Tensor:
        with replace_torch_checkpoint():
            return torch.utils.checkpoint.checkpoint(model, t, use_reentrant=False)

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    x = torch.randn(2, 8, requires_grad=True)
    assert torch.equal(compiled(x), model(x))
    assert torch.utils.checkpoint.checkpoint is TORCH_CHECKPOINT


def test_a_blocks_policy_reaches_the_library_calls() -> None:
    # timm's set_grad_checkpointing() with selective saving: the block's policy
    # keeps each Linear's output, so the recompute runs no matmul again (and,
    # as GELU saves only that output, stops before anything else runs).
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)]
    )
    x = torch.randn(4, 8, requires_grad=True)
    with replace_torch_checkpoint(policy=[torch.ops.aten.addmm]):
        y = library_every_block(model, x)
    with OpCounter() as backward_ops:
        y.sum().backward()
    assert "addmm" not in backward_ops.counts  # kept, not recomputed
    with replace_torch_checkpoint():
        y = library_every_block(model, x)
    with OpCounter() as backward_ops:
        y.sum().backward()
    assert backward_ops.counts.get("addmm") == 3  # without the policy


def under_block(library: Any, **options: Any) -> Any:
    def call(model: nn.Module, x: torch.Tensor) -> Any:
        with replace_torch_checkpoint(**options):
            return library(model, x)

    return call


@pytest.mark.parametrize("library", [library_every_block, library_sequential])
def test_a_blocks_options_fill_what_the_call_leaves_out(library: Any) -> None:
    x = torch.randn(5, 8, requires_grad=True)
    # the block's policy: still bitwise the plain run (dropout, BatchNorm)
    assert_matches_plain(
        dropout_chain(), x, under_block(library, policy="compute_heavy")
    )
    # the block's preserve_rng_state=False reaches a call that does not pass it:
    # the recompute draws other dropout masks, so the gradients differ
    with pytest.raises(AssertionError, match="differ"):
        assert_matches_plain(
            dropout_chain(), x, under_block(library, preserve_rng_state=False)
        )


def test_the_calls_own_keywords_win_over_the_blocks() -> None:
    def library_keeping_rng(model: nn.Module, x: torch.Tensor) -> Any:
        for block in model:  # as timm's checkpoint_seq passes it
            x = torch.utils.checkpoint.checkpoint(
                block, x, use_reentrant=False, preserve_rng_state=True
            )
        return x

    x = torch.randn(5, 8, requires_grad=True)
    assert_matches_plain(
        dropout_chain(),
        x,
        under_block(library_keeping_rng, preserve_rng_state=False),
    )


def test_nested_blocks_add_to_the_options_around_them() -> None:
    seen: list[dict[str, Any]] = []

    def spy(function: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return function(*args)

    module = sys.modules["seqckpt.torch_drop_in"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "checkpoint", spy)
        with replace_torch_checkpoint(policy="compute_heavy", early_stop=False):
            with replace_torch_checkpoint(early_stop=True, debug=True):
                torch.utils.checkpoint.checkpoint(torch.sin, torch.ones(1))
            torch.utils.checkpoint.checkpoint(torch.sin, torch.ones(1), debug=False)
    assert seen == [
        {"policy": "compute_heavy", "early_stop": True, "debug": True},
        {"policy": "compute_heavy", "early_stop": False, "debug": False},
    ]


def test_bad_options_fail_when_the_block_opens() -> None:
    with pytest.raises(TypeError, match=r"^seqckpt: .*unknown option 'polcy'"):
        replace_torch_checkpoint(polcy="compute_heavy")
    with pytest.raises(ValueError, match=r"^seqckpt: argument 'determinism_check'"):
        replace_torch_checkpoint(determinism_check="exact")
    with pytest.raises(TypeError, match=r"^seqckpt: argument 'early_stop'"):
        replace_torch_checkpoint(early_stop="no")
    assert torch.utils.checkpoint.checkpoint is TORCH_CHECKPOINT


# ------------------------------------------- torch 2.14's curried form, keyword


class Doubles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.3)

    @seqckpt.checkpoint(policy="compute_heavy")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x).sin()).cos()


def test_checkpoint_with_options_only_is_a_decorator() -> None:
    # torch 2.14: checkpoint(**options)(fn), also on methods
    def block(t: torch.Tensor) -> torch.Tensor:
        inside.append(seqckpt.is_checkpointing() or seqckpt.is_recomputing())
        return t.sin().cos()

    inside: list[bool] = []
    wrapped = seqckpt.checkpoint(preserve_rng_state=False)(block)
    assert isinstance(wrapped, seqckpt.CheckpointedFunction)
    assert wrapped.__name__ == "block"
    x = torch.randn(4, requires_grad=True)
    wrapped(x).sum().backward()
    assert inside == [True, True]  # its forward and its recompute
    assert x.grad is not None and torch.equal(x.grad, -torch.sin(x.sin()) * x.cos())
    x = torch.randn(3, 6, requires_grad=True)
    assert_matches_plain(
        Doubles(),
        x,
        lambda m, t: m(t),
        plain=lambda m, t: Doubles.forward.function(m, t),  # undecorated
    )


def test_curried_form_checks_its_options_at_once() -> None:
    with pytest.raises(ValueError, match=r"^seqckpt: argument 'determinism_check'"):
        seqckpt.checkpoint(determinism_check="exact")
    with pytest.raises(TypeError, match=r"^seqckpt: checkpoint\(\) without a func"):
        seqckpt.checkpoint(scale=2.0)
    with pytest.raises(TypeError, match=r"^seqckpt: argument 'respect_saved_"):
        seqckpt.checkpoint(torch.sin, torch.ones(1), respect_saved_tensors_hooks=1)


def test_torchs_curried_form_inside_a_block_is_seqckpts() -> None:
    x = torch.randn(4, requires_grad=True)
    with replace_torch_checkpoint():
        wrapped = torch.utils.checkpoint.checkpoint(use_reentrant=False)(torch.sin)
    assert isinstance(wrapped, seqckpt.CheckpointedFunction)
    wrapped(x).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, x.cos())


def test_respect_saved_tensors_hooks_reaches_torchs_selective_checkpointing() -> None:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    made: list[Any] = []

    def context_fn() -> Any:
        contexts = create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
        made.append(contexts[0])
        return contexts

    x = torch.randn(4, 4, requires_grad=True)
    for respect in (True, False):
        out = seqckpt.checkpoint(
            lambda t: (t @ t).sin(),
            x,
            context_fn=context_fn,
            respect_saved_tensors_hooks=respect,
        )
        out.sum().backward()
        assert made[-1].respect_saved_tensors_hooks is respect
    # accepted wherever checkpoint options are
    seqckpt.checkpoint_sequential(
        [nn.Linear(4, 4), nn.Tanh()], 2, x, respect_saved_tensors_hooks=True
    ).sum().backward()
    for respect in (True, False):
        model = seqckpt.CheckpointedSequential(
            nn.Linear(4, 4),
            nn.Tanh(),
            segments=2,
            context_fn=context_fn,
            respect_saved_tensors_hooks=respect,
        )
        model(x).sum().backward()
        assert made[-1].respect_saved_tensors_hooks is respect
    with replace_torch_checkpoint(respect_saved_tensors_hooks=False):
        torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "_current_user_saved_tensors_hooks"),
    reason="torch < 2.14: its selective checkpointing does not look for user hooks",
)
def test_torchs_selective_checkpointing_looks_past_seqckpts_hooks() -> None:
    # torch 2.14's selective checkpointing looks for the user's saved-tensor
    # hooks around it. It took seqckpt's for them: a FutureWarning at every
    # call, and with respect_saved_tensors_hooks=True its kept tensors went
    # into the region's recompute ("aten.matmul.default ... not found").
    import warnings

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def context_fn() -> Any:
        return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])

    x = torch.randn(4, 4, requires_grad=True)
    (want,) = torch.autograd.grad((x @ x).sin().sum(), x)
    packed: dict[Any, int] = {}
    for respect in (None, True, False):
        packed[respect] = 0

        def count(t: torch.Tensor, respect: Any = respect) -> torch.Tensor:
            packed[respect] += 1
            return t

        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            out = seqckpt.checkpoint(
                lambda t: (t @ t).sin(),
                x,
                context_fn=context_fn,
                respect_saved_tensors_hooks=respect,
            )
            (got,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(got, want)
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            out = seqckpt.checkpoint(
                lambda t: (t @ t).sin(),
                x,
                context_fn=context_fn,
                respect_saved_tensors_hooks=bool(respect),
            )
        (got,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(got, want)
    assert packed[True] > packed[False]  # the kept mm output went through it
