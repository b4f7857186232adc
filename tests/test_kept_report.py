"""seqckpt.what_is_kept: the report names exactly what a region with the policy
keeps (checked against what its recompute is served and runs, and against the
profile's measured bytes) and leaves the model as it found it."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import seqckpt
from seqckpt.models import GPTBlock
from seqckpt.policies import names, uncounted_op
from tests.test_robustness import NoiseOfItsOwn


def keep_everything(op: Any, *args: Any, **kwargs: Any) -> bool:
    return True


def keeps_gelu(op: Any, *args: Any, **kwargs: Any) -> bool:
    return op is torch.ops.aten.gelu.default


class NamedBlock(nn.Module):
    """A GPT block whose attention scores and MLP activation carry names."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = seqckpt.name(q @ k.transpose(-1, -2), "scores")
        x = x + scores.softmax(-1) @ v
        return x + self.down(seqckpt.name(torch.relu(self.up(x)), "act"))


POLICIES = {
    "compute_heavy": "compute_heavy",
    "callable": keeps_gelu,
    "everything": keep_everything,
    "names": names("scores", "act", "never_named"),
}


class RecomputedOps(TorchDispatchMode):  # type: ignore[misc]
    """The ops a recompute runs (not those served to it), as policies count them."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if seqckpt.is_recomputing() and not uncounted_op(func, args):
            self.ran[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def block_and_input(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    block: nn.Module = NamedBlock() if kind == "names" else GPTBlock(16, 2)
    return block, torch.randn(2, 8, 16, requires_grad=True)


@pytest.mark.parametrize("kind", list(POLICIES))
def test_the_recompute_runs_what_is_not_kept(kind: str) -> None:
    policy = POLICIES[kind]
    block, x = block_and_input(kind)
    report = seqckpt.what_is_kept(block, x, policy=policy)
    assert report.outputs, "the policy keeps something here"
    assert report.ops == len(report.outputs) + sum(report.recomputed.values())
    out = seqckpt.checkpoint(block, x, policy=policy, early_stop=False)
    with RecomputedOps() as mode:
        out.sum().backward()
    assert dict(mode.ran) == report.recomputed


@pytest.mark.parametrize("policy", ["compute_heavy", keep_everything])
def test_kept_bytes_are_those_the_profile_measures(policy: Any) -> None:
    block, x = block_and_input("gpt")
    report = seqckpt.what_is_kept(block, x.detach(), policy=policy)
    profile = seqckpt.profile(nn.Sequential(block), x.detach(), policies=[policy])
    (cost,) = profile.layers[0].policies
    assert report.kept_bytes == cost.kept_bytes > 0


def test_names_are_reported_with_their_labels() -> None:
    block, x = block_and_input("names")
    report = seqckpt.what_is_kept(block, x, policy=POLICIES["names"])
    labels = {o.label: o for o in report.outputs}
    assert set(labels) == {"scores", "act"}  # never_named is never reached
    assert labels["scores"].shapes == ((2, 8, 8),)
    assert labels["act"].op == "aten::relu"
    text = str(report)
    assert "scores" in text and "aten::relu" in text and "keeps 2 of" in text


def test_what_the_run_changes_is_put_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), NoiseOfItsOwn(8)
    )
    model[2].eval()  # a training flag the run must not change either
    x = torch.randn(4, 8, requires_grad=True)
    buffers = [b.clone() for b in model.buffers()]
    rng, own = torch.get_rng_state(), model[3].gen.get_state()
    report = seqckpt.what_is_kept(model, x, policy=keep_everything)
    assert "aten::addmm" in {o.op for o in report.outputs}
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.equal(own, model[3].gen.get_state())
    assert [m.training for m in model] == [True, True, False, True]
    assert x.grad is None and all(p.grad is None for p in model.parameters())


def test_a_policy_is_needed() -> None:
    with pytest.raises(ValueError, match=r"seqckpt: what_is_kept\(\) needs a policy"):
        seqckpt.what_is_kept(nn.Linear(2, 2), torch.randn(1, 2), policy=None)


def test_ops_returning_lists_and_numbers_are_listed() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, 2, dim=1)
        return (a * a.sum().item() + b).tanh()

    report = seqckpt.what_is_kept(f, torch.randn(3, 4), policy=keep_everything)
    by_op = {o.op: o for o in report.outputs}
    assert by_op["aten::split"].shapes == ((3, 2), (3, 2))
    assert by_op["aten::_local_scalar_dense"].dtype is None  # .item(): a number
    assert "aten::_local_scalar_dense" in str(report)


def test_calls_kept_whole_are_reported_and_not_the_policys() -> None:
    """A seqckpt.keep call inside the function: its ops are neither kept by
    the policy nor recomputed, in the report as in the region."""
    block, x = block_and_input("gpt")

    def keeping(t: torch.Tensor) -> torch.Tensor:
        t = t + seqckpt.keep(block.attention, t)
        return t + block.down(torch.nn.functional.gelu(block.up(block.norm2(t))))

    report = seqckpt.what_is_kept(keeping, x, policy="compute_heavy")
    assert report.kept_whole == ("GPTBlock.attention",)
    assert "kept whole by seqckpt.keep (not recomputed): GPTBlock.attention x1" in str(
        report
    )
    assert len(report.outputs) == 2  # the MLP's two matmuls
    out = seqckpt.checkpoint(keeping, x, policy="compute_heavy", early_stop=False)
    with RecomputedOps() as mode:
        out.sum().backward()
    assert dict(mode.ran) == report.recomputed
