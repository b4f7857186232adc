"""seqckpt.planner.twins: which chain items cost the same, and the profile that
measures only the first of each kind."""

from __future__ import annotations

import functools

import torch
from torch import nn

import seqckpt
from seqckpt.planner.twins import twin_key


class Block(nn.Module):
    """A residual MLP block that records the grad mode of each call."""

    def __init__(self, width: int = 16, scale: float = 1.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.scale = scale
        self.calls: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(torch.is_grad_enabled())
        out: torch.Tensor = x + self.scale * self.down(torch.tanh(self.up(x)))
        return out


class Halve(nn.Module):
    """Keeps the first half of the sequence: each call's output is smaller."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x[:, : x.shape[1] // 2])


def test_equal_blocks_with_equal_inputs_are_twins() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    assert twin_key(Block(), x) == twin_key(Block(), x)
    assert twin_key(nn.GELU(), x) == twin_key(nn.GELU(), x)


def test_what_makes_items_distinct() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    base = twin_key(Block(), x)
    assert twin_key(Block(scale=0.5), x) != base  # an attribute
    assert twin_key(Block(width=16).double(), x) != base  # parameter dtypes
    assert twin_key(Block(), torch.randn(8, 16, requires_grad=True)) != base  # shape
    assert twin_key(Block(), x.detach()) != base  # input requires_grad
    assert twin_key(Block(), torch.randn(16, 4).t()) != twin_key(
        Block(), torch.randn(4, 16)
    )
    frozen = Block()
    frozen.up.weight.requires_grad_(False)
    assert twin_key(frozen, x) != base
    evaluated = Block()
    evaluated.down.eval()
    assert twin_key(evaluated, x) != base
    assert twin_key(nn.GELU(approximate="tanh"), x) != twin_key(nn.GELU(), x)


def test_hooks_scripts_and_functions() -> None:
    x = torch.randn(4, 16)
    hooked = Block()
    hooked.up.register_forward_hook(lambda m, i, o: None)
    assert twin_key(hooked, x) is None
    assert twin_key(torch.jit.script(nn.Linear(16, 16)), x) is None
    assert twin_key(torch.tanh, x) == twin_key(torch.tanh, x)
    assert twin_key(torch.tanh, x) != twin_key(torch.sigmoid, x)
    # two partials of one function are two objects: measured separately
    assert twin_key(functools.partial(torch.pow, exponent=2), x) != twin_key(
        functools.partial(torch.pow, exponent=2), x
    )


def test_cycles_make_an_item_distinct() -> None:
    x = torch.randn(4, 16)
    parent = Block()
    object.__setattr__(parent.up, "owner", parent)  # a plain back-reference
    assert twin_key(parent, x) is None
    looped = Block()
    looped.scale = []  # type: ignore[assignment]
    looped.scale.append(looped.scale)  # type: ignore[attr-defined]
    assert twin_key(looped, x) is None


def test_the_profile_measures_the_first_twin_and_copies_it() -> None:
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(8, 16), *[Block() for _ in range(4)])
    x = torch.randn(32, 8)
    prof = seqckpt.profile(chain, x, repeats=2, policies=("compute_heavy",))
    blocks = [chain[k] for k in range(1, 5)]
    assert isinstance(blocks[0], Block)
    assert any(blocks[0].calls)  # measured with grad
    for twin in blocks[1:-1]:
        assert isinstance(twin, Block)
        assert twin.calls == []  # not run: the first block's output stands in
    # the chain's last item is measured itself: its output, the chain's, is
    # held by the caller through backward (a twin's backward freed it)
    assert isinstance(blocks[-1], Block) and any(blocks[-1].calls)
    first = prof.layers[1]
    assert all(layer == first for layer in prof.layers[2:-1])
    # the copied figures are what measuring every block gives
    each = seqckpt.profile(
        chain, x, repeats=1, policies=("compute_heavy",), twins=False
    )
    assert all(isinstance(b, Block) and any(b.calls[1:]) for b in blocks[1:])
    for field in ("input_bytes", "output_bytes", "saved_bytes", "held_bytes",
                  "forward_peak_bytes", "nograd_peak_bytes",
                  "backward_peak_bytes"):  # fmt: skip
        assert [getattr(p, field) for p in each.layers[1:-1]] == [
            getattr(first, field)
        ] * 3, field
        assert getattr(prof.layers[-1], field) == getattr(each.layers[-1], field)
    kept = [p.policies[0].kept_bytes for p in each.layers[1:]]
    assert kept == [first.policies[0].kept_bytes] * 4


def test_items_whose_inputs_change_shape_are_measured_each() -> None:
    chain = nn.Sequential(*[Halve() for _ in range(3)])
    prof = seqckpt.profile(chain, torch.randn(2, 64, 8, requires_grad=True), repeats=1)
    outputs = [layer.output_bytes for layer in prof.layers]
    assert outputs == [2 * 32 * 8 * 4, 2 * 16 * 8 * 4, 2 * 8 * 8 * 4]


def test_twins_keep_the_profile_sandboxed() -> None:
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
                            for _ in range(3)])  # fmt: skip
    stats = [b.clone() for b in chain.buffers()]
    seqckpt.profile(chain, torch.randn(16, 8), repeats=1)
    assert all(torch.equal(a, b) for a, b in zip(stats, chain.buffers(), strict=True))
