"""The oracle every parity test uses: run a model plainly and checkpointed from the
same RNG state and compare outputs, input gradients, every parameter gradient,
every buffer and the RNG state left behind, bitwise."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from seqckpt._tree import replace_tensors, tensors_in


def _grads_of(inputs: Any) -> list[torch.Tensor | None]:
    return [t.grad for t in tensors_in(inputs) if t.requires_grad]


def _fresh(inputs: Any) -> Any:
    """A copy of ``inputs`` whose leaf tensors have no grad yet."""
    return replace_tensors(
        inputs,
        [
            t.detach().clone().requires_grad_(t.requires_grad)
            for t in tensors_in(inputs)
        ],
    )


def _loss(output: Any) -> torch.Tensor:
    parts = [t.float().sum() for t in tensors_in(output) if t.requires_grad]
    return torch.stack(parts).sum()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Sparse gradients (``nn.Embedding(sparse=True)``) compared by their
    values: torch.equal has no sparse kernel."""
    return t.to_dense() if t.is_sparse else t


def assert_equal_tensors(a: Any, b: Any, what: str) -> None:
    ta, tb = tensors_in(a), tensors_in(b)
    assert len(ta) == len(tb), f"{what}: {len(ta)} tensors vs {len(tb)}"
    for i, (x, y) in enumerate(zip(map(_dense, ta), map(_dense, tb), strict=False)):
        assert torch.equal(x, y), f"{what}[{i}] differs: max {(x - y).abs().max()}"


def run_step(
    model: nn.Module, inputs: Any, call: Callable[[nn.Module, Any], Any], seed: int
) -> dict[str, Any]:
    """One training step (forward, sum of outputs, backward) from RNG ``seed``."""
    torch.manual_seed(seed)
    output = call(model, inputs)
    _loss(output).backward()
    return {
        "output": output,
        "input_grads": _grads_of(inputs),
        "param_grads": [p.grad for p in model.parameters()],
        "buffers": list(model.buffers()),
        "rng": torch.get_rng_state(),
    }


def assert_matches_plain(
    model: nn.Module | Callable[[], nn.Module],
    inputs: Any,
    checkpointed: Callable[[nn.Module, Any], Any],
    plain: Callable[[nn.Module, Any], Any] = lambda m, x: m(x),
    seed: int = 0,
) -> None:
    """Assert that ``checkpointed(model, inputs)`` trains exactly like ``plain``.

    Both run on deep copies of ``model`` (or two models from a factory: deep
    copies of TorchScript modules have non-leaf parameters) and of ``inputs``
    (fresh leaves), from the same RNG seed; outputs, input grads, parameter
    grads, buffers and the RNG state after backward must be bitwise equal.
    """
    if isinstance(model, nn.Module):
        module = model
        model = lambda: copy.deepcopy(module)  # noqa: E731
    ref = run_step(model(), _fresh(inputs), plain, seed)
    got = run_step(model(), _fresh(inputs), checkpointed, seed)
    if ref["param_grads"]:
        assert any(g is not None for g in ref["param_grads"]), "no parameter got a grad"
    assert_equal_tensors(got["output"], ref["output"], "output")
    assert_equal_tensors(got["input_grads"], ref["input_grads"], "input grad")
    for i, (g, r) in enumerate(
        zip(got["param_grads"], ref["param_grads"], strict=False)
    ):
        assert (g is None) == (r is None), f"param grad {i}: {g} vs {r}"
        if g is not None:
            assert torch.equal(_dense(g), _dense(r)), f"param grad {i} differs"
    assert_equal_tensors(got["buffers"], ref["buffers"], "buffer")
    assert torch.equal(got["rng"], ref["rng"]), "RNG state after backward differs"
