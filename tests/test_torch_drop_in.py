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


def test_the_functions_are_swapped_inside_and_given_back() -> None:
    with replace_torch_checkpoint():
        assert torch.utils.checkpoint.checkpoint is seqckpt.checkpoint
        assert torch.utils.checkpoint.checkpoint_sequential is (
            seqckpt.checkpoint_sequential
        )
        with replace_torch_checkpoint():  # nested
            pass
        assert torch.utils.checkpoint.checkpoint is seqckpt.checkpoint
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
            seen_in_second.append(
                torch.utils.checkpoint.checkpoint is seqckpt.checkpoint
            )

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert first_closed.is_set() and second_open.is_set()
    assert seen_in_second == [True]  # still seqckpt's after the first block ended
    assert torch.utils.checkpoint.checkpoint is TORCH_CHECKPOINT
    assert torch.utils.checkpoint.checkpoint_sequential is TORCH_CHECKPOINT_SEQUENTIAL


@pytest.mark.parametrize("library", [library_every_block, library_sequential])
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
