"""seqckpt.keep: a call a region keeps whole is not run again in the recompute,
and the step stays bitwise the plain run's."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import seqckpt
from seqckpt.memory import track_memory
from seqckpt.planner.frontier import TORCH_SAC
from seqckpt.policies import COMPUTE_HEAVY
from tests.counting import OpCounter
from tests.oracle import assert_matches_plain
from tests.test_robustness import chains, plans


class Block(nn.Module):
    """A pre-norm attention block whose attention branch (dropout inside) goes
    through ``seqckpt.keep``, followed by a batch norm and an MLP with dropout:
    every kind of state the recompute must see as the forward did."""

    def __init__(self, kept: bool = True, in_place: bool = False) -> None:
        super().__init__()
        self.kept, self.in_place = kept, in_place
        self.norm1 = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.2, batch_first=True)
        self.bn = nn.BatchNorm1d(5)
        self.norm2 = nn.LayerNorm(16)
        self.mlp = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 16)
        )
        self.attention_calls = 0

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        self.attention_calls += 1
        out: torch.Tensor = self.attn(h, h, h, need_weights=False)[0]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        a = seqckpt.keep(self.attention, h) if self.kept else self.attention(h)
        if self.in_place:
            a.mul_(0.5)  # the kept output changes after the call
        x = x + self.bn(a)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


def blocks(n: int = 2, **kwargs: Any) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(**kwargs) for _ in range(n)])


def sample(batch: int = 3) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, 5, 16, requires_grad=True)


def attention_calls(model: nn.Module) -> int:
    return sum(m.attention_calls for m in model.modules() if isinstance(m, Block))


@pytest.mark.parametrize("policy", [None, "compute_heavy"])
@pytest.mark.parametrize("check", ["default", "values"])
def test_kept_calls_train_bitwise(policy: str | None, check: str) -> None:
    assert_matches_plain(
        blocks(),
        sample(),
        lambda m, x: seqckpt.checkpoint(
            m, x, policy=policy, determinism_check=check, debug=True
        ),
    )


def test_kept_calls_in_a_chain_and_in_nested_regions() -> None:
    assert_matches_plain(
        blocks(4), sample(), lambda m, x: seqckpt.checkpoint_sequential(m, 2, x)
    )

    def nested(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def outer(x: torch.Tensor) -> torch.Tensor:
            for block in m:
                x = seqckpt.checkpoint(block, x)
            return x

        return seqckpt.checkpoint(outer, x)  # type: ignore[no-any-return]

    assert_matches_plain(blocks(), sample(), nested)


def test_the_recompute_does_not_run_a_kept_call_again() -> None:
    model = blocks()
    out = seqckpt.checkpoint(model, sample())
    assert attention_calls(model) == 2
    out.sum().backward()
    assert attention_calls(model) == 2  # the MLPs were recomputed, not these

    unkept = blocks(kept=False)
    seqckpt.checkpoint(unkept, sample()).sum().backward()
    assert attention_calls(unkept) == 4


def test_a_kept_output_written_in_place_afterwards_runs_again() -> None:
    model = blocks(in_place=True)
    seqckpt.checkpoint(model, sample()).sum().backward()
    assert attention_calls(model) == 4
    assert_matches_plain(
        blocks(in_place=True), sample(), lambda m, x: seqckpt.checkpoint(m, x)
    )


def test_kept_calls_hold_what_they_save_and_nothing_else() -> None:
    """The step's peak lies between the region that keeps nothing and the
    plain run, and the kept attention's share is what the attention saves."""

    def peak(model: nn.Module, call: Any) -> int:
        x = sample(16)
        call(model, x).sum().backward()  # warm up
        with track_memory() as memory:
            call(model, x).sum().backward()
        return memory.peak_bytes

    def region(m: nn.Module, x: torch.Tensor) -> Any:
        return seqckpt.checkpoint_sequential(m, 4, x)

    plain = peak(blocks(4), lambda m, x: m(x))
    nothing = peak(blocks(4, kept=False), region)
    kept = peak(blocks(4), region)
    assert nothing < kept < plain


def test_the_call_keeps_what_it_returns_and_gets_its_keywords() -> None:
    ran = []

    def block(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        a, b = seqckpt.keep(torch.chunk, x.sin(), 2, dim=-1)

        def scaled(t: torch.Tensor, s: torch.Tensor) -> dict[str, Any]:
            ran.append(1)  # a nested function, made anew in the recompute
            return {"value": t * s, "label": "kept"}

        c = seqckpt.keep(scaled, a, s=scale)
        assert c["label"] == "kept"
        d = seqckpt.keep(lambda t: t.exp(), c["value"])  # a lambda too
        return (d * b).cos()

    x = torch.randn(4, 6, requires_grad=True)
    scale = torch.randn(3, requires_grad=True)
    expected = torch.autograd.grad(block(x, scale).sum(), (x, scale))
    ran.clear()
    got = torch.autograd.grad(seqckpt.checkpoint(block, x, scale).sum(), (x, scale))
    assert len(ran) == 1  # served in the recompute, not run again
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_policy_outputs_after_a_kept_call_are_still_served() -> None:
    """The ops inside a kept call are not numbered by the policy's dispatch
    mode, so the ones after it are served in the recompute as without it."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        return second(seqckpt.keep(first, x).relu()).tanh()

    out = seqckpt.checkpoint(block, torch.randn(4, 8), policy="compute_heavy")
    with OpCounter() as counter:
        out.sum().backward()
    assert "addmm" not in counter.counts  # neither kept call nor served one ran


def test_under_torchs_selective_checkpointing_a_kept_call_runs_again() -> None:
    """torch's selective checkpointing numbers ops in both passes and cannot
    be set aside, so the call is run again (and what it caches stays right)."""
    model = blocks()
    seqckpt.checkpoint(model, sample(), context_fn=TORCH_SAC).sum().backward()
    assert attention_calls(model) == 4
    assert_matches_plain(
        blocks(), sample(), lambda m, x: seqckpt.checkpoint(m, x, context_fn=TORCH_SAC)
    )


def test_two_backward_passes_over_kept_calls() -> None:
    def twice(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = seqckpt.checkpoint(m, x)
        out.sum().backward(retain_graph=True)
        return out  # the oracle's backward is the second

    assert_matches_plain(
        blocks(), sample(), twice, plain=lambda m, x: _plain_twice(m, x)
    )


def _plain_twice(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x)
    out.sum().backward(retain_graph=True)
    return out  # type: ignore[no-any-return]


def test_outside_a_region_it_is_a_plain_call() -> None:
    x = torch.randn(3, requires_grad=True)
    assert torch.equal(seqckpt.keep(torch.sin, x), x.sin())
    assert seqckpt.keep(lambda: "no tensors") == "no tensors"
    # torch's own checkpoint is not a seqckpt region: the call runs again there
    model = blocks()
    torch.utils.checkpoint.checkpoint(
        model, sample(), use_reentrant=False
    ).sum().backward()
    assert attention_calls(model) == 4


def test_regions_made_inside_a_kept_call_are_regions_of_their_own() -> None:
    def block(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return seqckpt.keep(functools.partial(seqckpt.checkpoint, m), x).tanh()

    torch.manual_seed(2)
    assert_matches_plain(
        nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)),
        torch.randn(4, 8, requires_grad=True),
        lambda m, x: seqckpt.checkpoint(block, m, x),
        plain=lambda m, x: m(x).tanh(),
    )


def test_a_non_callable_is_named() -> None:
    with pytest.raises(TypeError, match=r"seqckpt: keep\(\) takes the callable"):
        seqckpt.keep(torch.ones(2))  # type: ignore[arg-type]


class Counted(nn.Module):
    """A two-layer branch that counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.inner(x)
        return out


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch = Counted()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.branch(x)
        out: torch.Tensor = x + self.mlp(x)
        return out


def test_keep_modules_keeps_every_matching_submodule() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Layer(), Layer(), Layer())
    assert seqckpt.keep_modules(model, "branch") == ["0.branch", "1.branch", "2.branch"]
    assert seqckpt.keep_modules(model, "branch") == ["0.branch", "1.branch", "2.branch"]
    assert_matches_plain(
        model,
        torch.randn(4, 16, requires_grad=True),
        lambda m, x: seqckpt.checkpoint_sequential(m, 3, x),
    )
    x = torch.randn(4, 16, requires_grad=True)
    seqckpt.checkpoint_sequential(model, 3, x).sum().backward()
    assert [layer.branch.calls for layer in model] == [1, 1, 1]
    model(x).sum().backward()  # outside a region: a plain call
    assert [layer.branch.calls for layer in model] == [2, 2, 2]


def test_keep_modules_on_torchs_transformer_layer() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(
        *[nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(2)]
    )
    assert seqckpt.keep_modules(layers, "self_attn", "linear2") == [
        "0.self_attn",
        "0.linear2",
        "1.self_attn",
        "1.linear2",
    ]
    assert_matches_plain(
        layers, sample(), lambda m, x: seqckpt.checkpoint_sequential(m, 2, x)
    )


def test_keep_modules_by_class() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Layer(), Layer())
    assert seqckpt.keep_modules(model, Counted) == ["0.branch", "1.branch"]
    x = torch.randn(4, 16, requires_grad=True)
    seqckpt.checkpoint_sequential(model, 2, x).sum().backward()
    assert [layer.branch.calls for layer in model] == [1, 1]


def test_keep_modules_names_what_it_did_not_find() -> None:
    model = nn.Sequential(Layer())
    with pytest.raises(ValueError, match=r"no submodule named 'attn'.*branch.*mlp"):
        seqckpt.keep_modules(model, "branch", "attn")
    with pytest.raises(
        ValueError, match=r"no submodule of class Conv2d.*Counted.*Linear"
    ):
        seqckpt.keep_modules(model, nn.Conv2d)
    with pytest.raises(ValueError, match="at least one submodule name"):
        seqckpt.keep_modules(model)
    with pytest.raises(TypeError, match="takes submodule names and nn.Module classes"):
        seqckpt.keep_modules(model, 3)  # type: ignore[arg-type]


def test_a_kept_module_copies_with_its_model() -> None:
    import copy
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(Layer())
    seqckpt.keep_modules(model, "branch")
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin[0].branch.forward.module is twin[0].branch
        x = torch.randn(2, 16)
        assert torch.equal(twin(x), model(x))


def test_a_kept_call_that_writes_into_its_argument_runs_again() -> None:
    """An in-place activation kept whole: the recompute must write the tensor
    again, since the code after it reads that tensor, not the call's output."""
    torch.manual_seed(0)
    relu = nn.ReLU(inplace=True)
    calls = []

    def activation(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return relu(t)

    def block(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = m[0](x)
        seqckpt.keep(activation, h)
        return m[1](h)  # reads h as the call left it

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(
        model, x, lambda m, x: seqckpt.checkpoint(block, m, x), plain=block
    )
    calls.clear()
    seqckpt.checkpoint(block, model, x).sum().backward()
    assert len(calls) == 2


def test_a_kept_batch_norm() -> None:
    """A batch norm kept whole saves its running statistics without the
    region's hooks, so autograd checks their versions in backward: the
    recompute's buffer replays must not move them (they did: "modified by an
    inplace operation"), and the statistics are updated once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    seqckpt.keep_modules(model, "1")
    assert_matches_plain(
        model,
        torch.randn(5, 4, requires_grad=True),
        lambda m, x: seqckpt.checkpoint(m, x),
    )


@pytest.mark.parametrize("returned", ["input", "parameter", "parameter view"])
def test_a_kept_call_may_return_what_the_region_holds_anyway(returned: str) -> None:
    """An input or a parameter comes back as the very object, which the
    region's hooks tell by identity: the recompute saves what the forward did."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    pick = {
        "input": lambda x: x,
        "parameter": lambda x: model.weight,
        "parameter view": lambda x: model.weight.t(),
    }[returned]

    def block(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = seqckpt.keep(pick, x)
        y = m(x) @ w if w.shape == (8, 8) else m(x) * w  # (both save w itself)
        return y.tanh() * w.sum()

    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(block(model, x).sum(), (x, model.weight))
    got = torch.autograd.grad(
        seqckpt.checkpoint(block, model, x).sum(), (x, model.weight)
    )
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@settings(max_examples=60, deadline=None)
@given(chains(), st.data())
def test_random_chains_with_kept_layers_match_plain(
    case: tuple[nn.Sequential, int], data: st.DataObject
) -> None:
    """Any layers of a random chain kept whole (dropout, batch norm, in-place
    writes inside, nested regions, generators of their own, ...), under a
    random nested plan whose stretches keep nothing or the compute-heavy ops."""
    model, width = case
    for i in data.draw(st.sets(st.integers(0, len(model) - 1))):
        model[i].forward = seqckpt.KeptForward(model[i])
    plan = data.draw(plans(0, len(model), policies=(None, COMPUTE_HEAVY)))
    check = data.draw(st.sampled_from(["default", "values"]))
    x = torch.randn(3, width, requires_grad=data.draw(st.booleans()))
    assert_matches_plain(
        model,
        x,
        lambda m, t: seqckpt.checkpoint_sequential(m, plan, t, determinism_check=check),
    )


@pytest.mark.cuda
def test_cuda_kept_call_with_backward_on_another_stream() -> None:
    torch.manual_seed(0)
    model = blocks().cuda()
    x = torch.randn(8, 5, 16, device="cuda", requires_grad=True)
    forward_stream, backward_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def run(use: bool) -> list[torch.Tensor]:
        x.grad = None
        model.zero_grad()
        torch.manual_seed(1)
        forward_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(forward_stream):
            y = seqckpt.checkpoint(model, x * 2) if use else model(x * 2)
        backward_stream.wait_stream(forward_stream)
        with torch.cuda.stream(backward_stream):
            y.sum().backward()
        torch.cuda.current_stream().wait_stream(backward_stream)
        torch.cuda.synchronize()
        return [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kept_modules_replicate_and_script() -> None:
    """DataParallel's replicas copy a module's attributes: each replica's
    kept forward runs the replica. torch.jit.script compiles a kept module's
    own forward (keep means nothing there); a scripted module can be kept."""
    torch.manual_seed(0)
    model = nn.Sequential(Layer(), Layer())
    seqckpt.keep_modules(model, "branch")
    replica = model[0].branch._replicate_for_data_parallel()
    assert replica.forward.module is replica
    again = replica._replicate_for_data_parallel()
    assert again.forward.module is again

    chain = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    seqckpt.keep_modules(chain, "0")
    x = torch.randn(2, 4)
    assert torch.equal(torch.jit.script(chain)(x), chain(x))

    def scripted() -> nn.Module:
        torch.manual_seed(0)
        inner = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
        model = nn.Sequential(inner, nn.Linear(4, 4), nn.GELU())
        seqckpt.keep_modules(model, "0")
        return model

    x = torch.randn(3, 4, requires_grad=True)
    assert_matches_plain(scripted, x, lambda m, x: seqckpt.checkpoint(m, x))
    out = seqckpt.checkpoint(scripted(), x)
    with OpCounter() as counter:
        out.sum().backward()
    assert counter.counts.get("tanh", 0) == 0  # the scripted part was kept
