"""Robustness: random chains and plans, threads, long runs, faults, hostile input.

Hostile input tried (each is a test below; "error" means a ``seqckpt:`` error of
the named type, "correct" means bitwise equal to the plain run):

| input                                              | result                     |
|----------------------------------------------------|----------------------------|
| modules not a chain (int, dict, module, generator) | TypeError naming modules   |
| empty chain (list, nn.Sequential)                  | ValueError naming modules  |
| non-callable item in the chain                     | TypeError naming the index |
| segments 0, -1, n+1, sizes not summing to n        | ValueError naming segments |
| segments 2.0, True, "2", None, object()            | TypeError naming segments  |
| a Plan for another chain length                    | PlanError (ValueError)     |
| malformed plan JSON (7 shapes)                     | PlanError                  |
| memory_budget 0, -1, "0MiB", "lots", True, 1.5     | ValueError / TypeError     |
| profile of another chain                           | PlanError                  |
| profile/plan/track_memory/validate wrong arguments | TypeError / ValueError     |
| NaN and inf in the input                           | correct (NaNs in place)    |
| a zero-size batch                                  | correct                    |
| input and model on different devices (meta / cpu)  | torch's own error, raised  |
| checkpointed function raising in forward/recompute | original exception, state restored |
| backward twice without retain_graph                | RuntimeError from autograd |
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import seqckpt
from seqckpt import CheckpointedSequential, checkpoint_sequential
from seqckpt._buffers import COPY_LIMIT
from seqckpt.planner import Plan, PlanError, Recompute, Run
from seqckpt.policies import COMPUTE_HEAVY, Policy
from tests.oracle import assert_matches_plain

# ------------------------------------------------------------ random chains


class Split(nn.Module):
    """Tensor -> (tensor, tensor): a tuple flows to the next stage."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.sin(x)


class Join(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(pair[0]) * pair[1]


class Copies(nn.Module):
    """clone and detach: ops seqckpt's own bookkeeping runs too, so a policy
    that numbered them served the wrong tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone().tanh() + x.detach() * 0.5


class Attention(nn.Module):
    """Scaled-dot-product attention with dropout (random in training) and a
    residual: the selective policies' favourite op."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(0).chunk(3, -1)
        p = 0.1 if self.training else 0.0
        attended = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return x + attended.squeeze(0)


class InPlaceInside(nn.Module):
    """An activation applied in place to an intermediate (not to the input)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu_() + x


class Nested(nn.Module):
    """A block that checkpoints part of itself, with or without a policy."""

    def __init__(self, width: int, policy: str | None) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.2))
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + seqckpt.checkpoint(self.inner, x, policy=self.policy)


class NoiseOfItsOwn(nn.Module):
    """Noise drawn from a torch.Generator the module holds (the default one
    stays untouched), or from one the caller passes: the recompute must draw
    what the forward drew (before, it drew the next numbers)."""

    def __init__(self, width: int, seed: int = 7) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(
        self, x: torch.Tensor, gen: torch.Generator | None = None
    ) -> torch.Tensor:
        h = self.lin(x)
        return h * torch.rand(h.shape, generator=gen or self.gen)


class DropPath(nn.Module):
    """Stochastic depth as timm and HF write it: an out-of-place draw from the
    default generator (``torch.rand``), unlike dropout's in-place
    ``bernoulli_``. A policy that keeps that draw must leave the generator
    where the draw left it, or later dropout in the region draws other masks."""

    def __init__(self, keep: float = 0.7) -> None:
        super().__init__()
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (self.keep + torch.rand(x.shape[0], 1)).floor()
        return x * mask / self.keep


class StatsHook(nn.Module):
    """A statistics hook that skips the recompute (as the README suggests),
    running a mean, as the model does, in the forward only."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.stats: list[torch.Tensor] = []
        self.lin.register_forward_hook(self.record)

    def record(self, module: nn.Module, args: object, out: torch.Tensor) -> None:
        if not seqckpt.is_recomputing():
            self.stats.append(out.detach().exp().mean(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h - h.mean(-1, keepdim=True)


class NamedAndWritten(nn.Module):
    """Views written in place, and names given before and after an in-place
    write (what a names policy may keep)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = seqckpt.name(self.lin(x), "lin")
        h[:, : h.shape[1] // 2 + 1].mul_(1.5)  # in place on a view
        g = nn.functional.silu(h)
        g.add_(1)
        return seqckpt.name(g, "act").tanh() + h.transpose(0, 1).reshape(h.shape)


class RunningTable(nn.Module):
    """A buffer of COPY_LIMIT bytes or more (copied at its first write in a
    region, not when the region starts) read in forward and, with ``writes``,
    moved in place afterwards through a view or through ``.data``: the
    recompute must read what the forward read."""

    def __init__(self, width: int, writes: str) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        rows = COPY_LIMIT // (4 * width) + 1
        self.register_buffer("table", torch.randn(rows, width))
        self.writes = writes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (self.lin(x) + self.table[0]).tanh()
        if self.writes == "view":
            with torch.no_grad():
                self.table[:1].mul_(0.9).add_(h.detach().mean(0))
        elif self.writes == "data":
            self.table.data[:1].mul_(0.9)
        return h


class DetachedNorm(nn.Module):
    """A scale computed with grad from the weight and then detached, as PEFT's
    DoRA computes its weight norm: what those ops save dies in forward, so a
    recompute must keep none of it (and still check it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.magnitude = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(self.lin.in_features)
        norm = self.lin(eye).exp().norm(dim=0).detach()
        return self.lin(x) * (self.magnitude / norm)


@st.composite
def chains(draw: st.DrawFn) -> tuple[nn.Sequential, int]:
    width = draw(st.integers(2, 12))
    items: list[nn.Module] = [nn.Linear(width, width)]  # something to train
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(
            st.sampled_from(
                [
                    "linear",
                    "dropout",
                    "bn",
                    "act",
                    "pair",
                    "copies",
                    "attention",
                    "in_place_inside",
                    "nested",
                    "own_noise",
                    "stats_hook",
                    "named_and_written",
                    "drop_path",
                    "running_table",
                    "detached_norm",
                ]
            )  # fmt: skip
        )
        if kind == "linear":
            items.append(nn.Linear(width, width))
        elif kind == "dropout":
            items.append(nn.Dropout(draw(st.sampled_from([0.1, 0.5]))))
        elif kind == "bn":
            items.append(nn.BatchNorm1d(width))
        elif kind == "act":
            items.append(draw(st.sampled_from([nn.GELU, nn.Tanh, nn.ReLU]))())
        elif kind == "copies":
            items.append(Copies())
        elif kind == "attention":
            items.append(Attention(width))
        elif kind == "in_place_inside":
            items.append(InPlaceInside(width))
        elif kind == "nested":
            items.append(Nested(width, draw(st.sampled_from([None, "compute_heavy"]))))
        elif kind == "own_noise":
            items.append(NoiseOfItsOwn(width, draw(st.integers(0, 1000))))
        elif kind == "stats_hook":
            items.append(StatsHook(width))
        elif kind == "named_and_written":
            items.append(NamedAndWritten(width))
        elif kind == "drop_path":
            items.append(DropPath())
        elif kind == "running_table":
            writes = draw(st.sampled_from(["none", "view", "data"]))
            items.append(RunningTable(width, writes))
        elif kind == "detached_norm":
            items.append(DetachedNorm(width))
        else:
            items += [Split(), Join(width)]
    torch.manual_seed(draw(st.integers(0, 1000)))
    return nn.Sequential(*items), width


@st.composite
def plans(
    draw: st.DrawFn,
    start: int,
    stop: int,
    depth: int = 0,
    policies: tuple[Policy | None, ...] = (None,),
) -> Plan:
    """A random plan tree over layers start..stop-1, nesting up to depth 2,
    each recomputed stretch keeping one of ``policies``."""
    items: list[Run | Recompute] = []
    at = start
    while at < stop:
        end = draw(st.integers(at + 1, stop))
        if depth < 2 and draw(st.booleans()):
            inner = draw(plans(at, end, depth + 1, policies))
            items.append(Recompute(at, end, inner, draw(st.sampled_from(policies))))
        else:
            items.append(Run(at, end))
        at = end
    return Plan(tuple(items))


@settings(max_examples=80, deadline=None)
@given(chains(), st.data())
def test_random_chains_and_segments_match_plain(
    case: tuple[nn.Sequential, int], data: st.DataObject
) -> None:
    model, width = case
    n = len(model)
    form = data.draw(st.sampled_from(["count", "sizes", "plan"]))
    if form == "count":
        segments: object = data.draw(st.integers(1, n))
    elif form == "sizes":
        cuts = sorted(
            data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1))
            if n > 1
            else set()
        )
        bounds = [0, *cuts, n]
        segments = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    else:
        segments = data.draw(plans(0, n))
    x = torch.randn(
        data.draw(st.integers(2, 6)), width, requires_grad=data.draw(st.booleans())
    )
    assert_matches_plain(model, x, lambda m, t: checkpoint_sequential(m, segments, t))


@settings(max_examples=40, deadline=None)
@given(chains(), st.data())
def test_random_chains_with_shared_layers_match_plain(
    case: tuple[nn.Sequential, int], data: st.DataObject
) -> None:
    """A layer applied at several places of the chain (ALBERT's shared layer,
    a block reused), in one region or in several, under a random nested plan
    whose stretches keep nothing or the compute-heavy ops: buffers updated
    as often as in the plain run, each region's recompute seeing its own
    first values."""
    model, width = case
    items = list(model)
    singles = [m for m in items if not isinstance(m, Split | Join)]
    for _ in range(data.draw(st.integers(1, 4))):
        shared = data.draw(st.sampled_from(singles))
        at = data.draw(st.integers(0, len(items)))
        opened = sum(isinstance(i, Split) for i in items[:at])
        if opened == sum(isinstance(i, Join) for i in items[:at]):  # not in a pair
            items.insert(at, shared)
    chain = nn.Sequential(*items)
    plan = data.draw(plans(0, len(chain), policies=(None, COMPUTE_HEAVY)))
    x = torch.randn(3, width, requires_grad=data.draw(st.booleans()))
    assert_matches_plain(chain, x, lambda m, t: checkpoint_sequential(m, plan, t))


# ------------------------------------------------------------------ threads


def _tanh_stack(seed: int) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)]
    )
    return model, torch.randn(64, 32)


def test_two_threads_train_two_models_at_once() -> None:
    # Models are built here: the global RNG is shared by threads (as in torch).
    cases = {seed: _tanh_stack(seed) for seed in (1, 2)}
    flags: dict[int, list[bool]] = {seed: [] for seed in cases}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def train(seed: int) -> None:
        model, x = cases[seed]
        try:
            barrier.wait()
            for _ in range(20):
                checkpoint_sequential(model, 4, x).sum().backward()
        except BaseException as error:  # reported by the main thread below
            errors.append(error)

    for seed, (model, _) in cases.items():
        model[0].register_forward_hook(
            lambda *_, seed=seed: flags[seed].append(seqckpt.is_recomputing())
        )
    threads = [threading.Thread(target=train, args=(seed,)) for seed in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for seed, (model, _) in cases.items():
        reference, x = _tanh_stack(seed)
        for _ in range(20):
            reference(x).sum().backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got.grad, want.grad)  # type: ignore[arg-type]
        # is_recomputing() is per thread: each thread saw its own forward (False)
        # and its own recompute (True) once per step, never the other's.
        assert flags[seed] == [False, True] * 20


# ---------------------------------------------------------------- long runs


def test_200_steps_leak_nothing_and_track_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(
        *[
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU())
            for _ in range(6)
        ]
    )
    ckpt = CheckpointedSequential.from_sequential(
        __import__("copy").deepcopy(plain), segments=3
    )
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.01)
    opt_ckpt = torch.optim.SGD(ckpt.parameters(), lr=0.01)
    x = torch.randn(32, 16)
    live = []
    with seqckpt.track_memory("cpu") as mem:
        for step in range(200):
            for model, opt in ((plain, opt_plain), (ckpt, opt_ckpt)):
                opt.zero_grad(set_to_none=False)
                model(x).pow(2).mean().backward()
                opt.step()
            if step in (10, 199):
                live.append(mem.live_bytes())
    assert live[0] == live[1], f"live bytes grew from {live[0]} to {live[1]}"
    for p, q in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p, q)
    for a, b in zip(plain.buffers(), ckpt.buffers(), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------- faults


class Fails(nn.Module):
    """Raises in forward, or only when recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mode = "never"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "forward" or (
            self.mode == "recompute" and seqckpt.is_recomputing()
        ):
            raise_original()
        return torch.dropout(self.lin(x), 0.5, True)


def raise_original() -> None:
    raise ValueError("original failure")


@pytest.mark.parametrize("when", ["forward", "recompute"])
def test_exception_propagates_and_state_is_restored(when: str) -> None:
    failing = Fails()
    model = nn.Sequential(nn.Linear(4, 4), failing, nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    failing.mode = when
    with pytest.raises(ValueError, match="original failure") as info:
        y = checkpoint_sequential(model, [2, 1], x).sum()  # failing one recomputed
        rng = torch.get_rng_state()  # reached only when forward succeeds
        y.backward()
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "raise_original" in frames and "forward" in frames
    assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    assert not seqckpt.is_recomputing() and not seqckpt.is_checkpointing()
    if when == "recompute":  # the recompute replayed the forward's RNG, then undid it
        assert torch.equal(torch.get_rng_state(), rng)
    # The next step works and matches the plain run.
    failing.mode = "never"
    assert_matches_plain(model, x, lambda m, t: checkpoint_sequential(m, [2, 1], t))


def test_backward_twice_without_retain_graph_raises() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    y = checkpoint_sequential(model, 2, torch.randn(2, 4, requires_grad=True)).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


# ----------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    "modules", [3, {"a": nn.Linear(2, 2)}, nn.Linear(2, 2), (m for m in [])]
)
def test_modules_of_wrong_type(modules: object) -> None:
    with pytest.raises(TypeError, match=r"^seqckpt: argument 'functions'"):
        checkpoint_sequential(modules, 1, torch.randn(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("modules", [[], nn.Sequential()])
def test_empty_chain(modules: object) -> None:
    with pytest.raises(ValueError, match="empty chain"):
        checkpoint_sequential(modules, 1, torch.randn(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("segments", [0, -1, 4, [1, 1], [3, 1]])
def test_segments_out_of_range(segments: object) -> None:
    chain = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ValueError, match=r"^seqckpt: segments") as info:
        checkpoint_sequential(chain, segments, torch.randn(2, 2))  # type: ignore[arg-type]
    assert str(segments) in str(info.value) and "3" in str(info.value)


@pytest.mark.parametrize("segments", [2.0, True, "2", None, object()])
def test_segments_of_wrong_type(segments: object) -> None:
    chain = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(TypeError, match=r"^seqckpt: segments"):
        checkpoint_sequential(chain, segments, torch.randn(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [0, -1, "0MiB", "lots", True, 1.5])
def test_bad_budgets(budget: object) -> None:
    chain = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises((ValueError, TypeError), match=r"^seqckpt: memory_budget"):
        seqckpt.plan(chain, torch.randn(2, 2), budget)  # type: ignore[arg-type]


def test_plan_for_another_chain_length() -> None:
    chain = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(PlanError, match="3 modules"):
        checkpoint_sequential(chain, Plan((Run(0, 4),)), torch.randn(2, 2))


def test_nan_and_inf_inputs_match_plain() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.GELU())
    x = torch.randn(3, 4)
    x[0, 0], x[1, 2] = float("nan"), float("inf")
    ref = model(x)
    got = checkpoint_sequential(model, 2, x)
    assert torch.equal(ref.isnan(), got.isnan())
    assert torch.equal(ref.nan_to_num(), got.nan_to_num())
    model.zero_grad()
    ref.sum().backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    got.sum().backward()
    for p, g in zip(model.parameters(), plain_grads, strict=True):
        assert torch.equal(p.grad.isnan(), g.isnan())  # type: ignore[union-attr]
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())  # type: ignore[union-attr]


def test_zero_size_batch_matches_plain() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    assert_matches_plain(
        model,
        torch.randn(0, 4, requires_grad=True),
        lambda m, t: checkpoint_sequential(m, 2, t),
    )


def test_mismatched_devices_raise_torchs_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises((RuntimeError, NotImplementedError)):
        checkpoint_sequential(model, 2, torch.randn(2, 4, device="meta"))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: seqckpt.profile(3, torch.randn(2, 2)), TypeError, "'modules'"),
        (lambda: seqckpt.profile([], torch.randn(2, 2)), ValueError, "empty chain"),
        (
            lambda: seqckpt.profile([nn.Linear(2, 2)], torch.randn(2, 2), repeats=0),
            ValueError,
            "repeats",
        ),
        (
            lambda: seqckpt.plan([nn.Linear(2, 2)], None, profile="x"),
            TypeError,
            "profile",
        ),  # type: ignore[arg-type]
        (lambda: seqckpt.track_memory("mps").__enter__(), ValueError, "'mps'"),
        (lambda: seqckpt.validate("nope"), ValueError, "unknown --model"),
    ],
    ids=[
        "profile-type",
        "profile-empty",
        "profile-repeats",
        "plan-profile",
        "memory-device",
        "validate-model",
    ],
)
def test_other_public_functions_reject_bad_input(call, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=f"^seqckpt: .*{match}"):
        call()
