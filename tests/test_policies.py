"""Selective saving: every form of policy, bitwise against the plain run, and
that a kept op is not run again in the recompute."""

from __future__ import annotations

import gc
import threading
import types
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import seqckpt
from seqckpt import checkpoint, checkpoint_sequential
from seqckpt.planner import Plan, Recompute, Run
from seqckpt.planner.frontier import TORCH_SAC
from seqckpt.policies import COMPUTE_HEAVY, Policy, as_policy, names, ops
from tests.counting import OpCounter
from tests.oracle import assert_matches_plain
from tests.test_robustness import Copies, chains, plans

aten = torch.ops.aten


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 8), nn.Tanh()
    )


def keeps_gelu(op: Any, *args: Any, **kwargs: Any) -> bool:
    return op is aten.gelu.default


def torch_keeps_gelu(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The same choice written for torch's selective checkpointing."""
    if op is aten.gelu.default and not ctx.is_recompute:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES: dict[str, Any] = {
    "none": None,
    "compute_heavy": "compute_heavy",
    "packets": [aten.addmm],
    "overloads": {aten.addmm.default, aten.gelu.default},
    "callable": keeps_gelu,
    "torch_callable": torch_keeps_gelu,
    "names": names("lin", "act"),  # what tests.test_robustness.NamedAndWritten names
    "mean": [aten.mean],  # what tests.test_robustness.StatsHook's hook runs
    "everything": lambda op, *a, **k: True,
}


@pytest.mark.parametrize("form", list(POLICIES))
def test_every_policy_form_is_bitwise(form: str) -> None:
    x = torch.randn(6, 8, requires_grad=True)
    assert_matches_plain(mlp(), x, lambda m, t: checkpoint(m, t, policy=POLICIES[form]))


@settings(max_examples=80, deadline=None)
@given(chains(), st.sampled_from(list(POLICIES)), st.data())
def test_policies_on_random_chains(case: Any, form: str, data: st.DataObject) -> None:
    model, width = case
    k = data.draw(st.integers(1, len(model)))
    x = torch.randn(4, width, requires_grad=True)
    assert_matches_plain(
        model,
        x,
        lambda m, t: checkpoint_sequential(m, k, t, policy=POLICIES[form]),
    )


@settings(max_examples=80, deadline=None)
@given(chains(), st.data())
def test_plans_with_a_policy_per_stretch_on_random_chains(
    case: Any, data: st.DataObject
) -> None:
    # every stretch of a random (nested) plan keeps what its own policy says,
    # none of them the last segment that runs plainly
    model, width = case
    forms = (None, *(as_policy(p) for p in POLICIES.values()))
    plan = data.draw(plans(0, len(model), policies=forms))
    check = data.draw(st.sampled_from(["default", "values"]))
    x = torch.randn(3, width, requires_grad=data.draw(st.booleans()))
    assert_matches_plain(
        model,
        x,
        lambda m, t: checkpoint_sequential(m, plan, t, determinism_check=check),
    )


def ops_in_backward(policy: Any) -> dict[str, int]:
    model = mlp()
    y = checkpoint(model, torch.randn(6, 8, requires_grad=True), policy=policy)
    with OpCounter() as counter:
        y.sum().backward()
    # (not detach: aliases autograd makes, more of them on torch 2.8 while the
    # recompute runs under the mode that serves kept outputs)
    counter.counts.pop("detach", None)
    return counter.counts


def test_a_kept_op_is_not_run_again() -> None:
    none = ops_in_backward(None)
    heavy = ops_in_backward("compute_heavy")
    gelu = ops_in_backward(keeps_gelu)
    # Without a policy the recompute runs both linear layers' addmm again.
    assert none["addmm"] == 2 and "addmm" not in heavy
    assert none["gelu"] == 1 and "gelu" not in gelu
    assert gelu["addmm"] == none["addmm"]
    # torch's CheckpointPolicy answers count by meaning (every member is true),
    # also from a policy written for torch's selective checkpointing (ctx first).
    assert ops_in_backward(torch_keeps_gelu) == gelu
    assert (
        ops_in_backward(lambda op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE) == none
    )
    # The backward's own matmuls are the same in all three.
    assert none["mm"] == heavy["mm"] == gelu["mm"]


def test_kept_outputs_cost_memory_until_the_recompute() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(128, 64, requires_grad=True)
    held = {}
    for form in (None, "compute_heavy"):
        with seqckpt.track_memory("cpu") as mem:
            y = checkpoint(block, x, policy=form)
            held[form] = mem.live_bytes()
            del y
    # the first matmul's output (128 x 256 floats) is what compute_heavy keeps
    assert held["compute_heavy"] - held[None] == 128 * 256 * 4


def relu_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
            for _ in range(4)
        ]
    )


def recompute_peak(policy: Any) -> int:
    """Peak while a 4-block region recomputes (its forward's memory excluded)."""
    from seqckpt._options import Options
    from seqckpt._region import _Region

    x = torch.randn(128, 64, requires_grad=True)
    options = Options(early_stop=False, policy=as_policy(policy))
    region = _Region(relu_chain(), (x,), {}, options, None)
    y = region.run()
    with seqckpt.track_memory("cpu") as mem:
        region._recompute()
    del y
    return mem.peak_bytes


def test_a_served_output_is_freed_when_its_consumers_are_done() -> None:
    # ReLU saves its output, not the first Linear's: in a plain recompute that
    # output dies after the ReLU, and a served one must too (not stay in the
    # cache to the end of the recompute, 4 x 128 x 256 floats here).
    assert recompute_peak("compute_heavy") <= recompute_peak(None)


def nested_plan() -> Plan:
    ch = as_policy("compute_heavy")
    inner = Plan((Recompute(0, 2, Plan((Run(0, 2),)), ch), Run(2, 3)))
    return Plan((Recompute(0, 3, inner), Run(3, 4)))


def test_a_nested_policy_region_keeps_from_its_parents_recompute() -> None:
    from seqckpt.executor import run_plan
    from seqckpt.planner.frontier import measure_peak

    model, x = relu_chain(), torch.randn(128, 64, requires_grad=True)
    plan = nested_plan()
    assert_matches_plain(model, x, lambda m, t: run_plan(plan, list(m), t))

    # The parent's recompute runs 5 addmm (blocks 0-2; the early stop skips
    # the last, which nothing saves); the inner region's recompute runs 3
    # without the policy (its last skipped the same way) and none with it: the
    # parent's recompute made and kept them, and the inner recompute serves them.
    def addmm_in_backward(plan: Plan) -> int:
        y = run_plan(plan, list(model), x)
        with OpCounter() as counter:
            y.sum().backward()
        return counter.counts["addmm"]

    plain_inner = Plan((Recompute(0, 2, Plan((Run(0, 2),))), Run(2, 3)))
    without = Plan((Recompute(0, 3, plain_inner), Run(3, 4)))
    assert (addmm_in_backward(plan), addmm_in_backward(without)) == (5, 5 + 3)
    # Kept outputs live from the parent's recompute to the inner recompute, as
    # the cost model has it (kept in the parent's forward they would also be
    # held through the whole rest of the step).
    prof = seqckpt.profile(model, x, repeats=1, policies=("compute_heavy",))
    predicted, _ = seqckpt.planner.plan_cost(plan, prof)
    peak = measure_peak(model, x, lambda m, t: run_plan(plan, list(m), t), "cpu")
    assert peak <= 1.01 * predicted


def test_a_nested_policy_region_leaves_no_reference_cycle() -> None:
    # A region with a policy nested in another is registered with its parent;
    # a strong reference both ways (the child's saver node unpacks through the
    # parent) held the parent's input, and all the region held, until the
    # garbage collector ran: 2.6% over the predicted peak on a GPT plan.
    model = relu_chain()

    def parent(t: torch.Tensor) -> torch.Tensor:
        return model[3](checkpoint(model[2], t, policy="compute_heavy"))

    def input_freed_by_refcounts() -> bool:
        h = model[1](model[0](torch.randn(128, 64, requires_grad=True)))
        alive = weakref.ref(h)
        y = checkpoint(parent, h)
        del h
        y.sum().backward()
        del y
        return alive() is None

    # Once with the collector on: the first policy region imports parts of
    # torch lazily, and an import's frames are themselves collected by it.
    input_freed_by_refcounts()
    gc.disable()
    try:
        assert input_freed_by_refcounts()
    finally:
        gc.enable()


def test_names_policy_keeps_what_user_code_names() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def named(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = seqckpt.name(m(x), "proj")
        return (h.relu() @ h.T).tanh()

    x = torch.randn(5, 8, requires_grad=True)
    policy = names("proj")
    assert_matches_plain(
        lin,
        x,
        lambda m, t: checkpoint(named, m, t, policy=policy),
        plain=named,
    )

    def block(t: torch.Tensor) -> torch.Tensor:
        return named(lin, t)

    y = checkpoint(block, x, policy=policy)
    with OpCounter() as counter:
        y.sum().backward()
    assert "addmm" not in counter.counts  # the named projection was kept
    y = checkpoint(block, x, policy=names("other"))
    with OpCounter() as counter:
        y.sum().backward()
    assert counter.counts.get("addmm") == 1
    assert seqckpt.name(x, "proj") is x  # outside a region: nothing happens


@pytest.mark.parametrize("named", ["written", "view_of_written"])
def test_a_name_given_after_an_in_place_write_is_not_served(named: str) -> None:
    # The named tensor was written in place after its op made it: its values
    # are not that op's output, so serving them as that output made the
    # recompute apply the write twice (wrong gradients, no error).
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def block(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(m(x))
        h.mul_(2)
        kept = seqckpt.name(h if named == "written" else h[:, :4], "h")
        return kept.tanh().sum() + h.sigmoid().sum()

    x = torch.randn(5, 8, requires_grad=True)
    assert_matches_plain(
        lin, x, lambda m, t: checkpoint(block, m, t, policy=names("h")), plain=block
    )


def test_names_in_two_threads_go_to_their_own_regions() -> None:
    # DataParallel runs replicas in threads. Thread "a" names its projection
    # while thread "b" is inside a region of its own: the name must reach a's
    # region (kept: a's recompute does not run the addmm again), not b's.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    a_inside, b_inside, a_named = (threading.Event() for _ in range(3))
    counts: dict[str, dict[str, int]] = {}
    failures: list[BaseException] = []

    def block(me: str, x: torch.Tensor) -> torch.Tensor:
        if me == "a":
            a_inside.set()
            b_inside.wait(10)
        else:
            b_inside.set()
            a_named.wait(10)
        h = seqckpt.name(lin(x), "proj")
        if me == "a":
            a_named.set()
        return (h.relu() @ h.T).tanh()

    def run(me: str) -> None:
        try:
            if me == "b":
                a_inside.wait(10)
            x = torch.randn(5, 8, requires_grad=True)
            y = checkpoint(block, me, x, policy=names("proj"))
            with OpCounter() as counter:
                y.sum().backward()
            counts[me] = counter.counts
        except BaseException as error:  # reported by the main thread below
            failures.append(error)

    threads = [threading.Thread(target=run, args=(me,)) for me in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures, failures
    assert "addmm" not in counts["a"] and "addmm" not in counts["b"]


class CentredPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(-1, keepdim=True)).tanh()


def test_forward_only_code_does_not_shift_what_is_served() -> None:
    # A statistics hook that skips the recompute (as the README suggests) runs
    # a mean the policy keeps in the forward only: matched by call number, the
    # recompute was served the hook's mean (same shape) in place of the
    # model's: wrong gradients, no error.
    stats: list[torch.Tensor] = []

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if not seqckpt.is_recomputing():
            stats.append(out.detach().exp().mean(-1, keepdim=True))

    torch.manual_seed(0)
    model = CentredPair()
    model.a.register_forward_hook(hook)
    x = torch.randn(4, 8, requires_grad=True)
    for policy in ([aten.mean], [aten.mean, aten.addmm]):
        assert_matches_plain(model, x, lambda m, t: checkpoint(m, t, policy=policy))
    assert len(stats) == 4  # (the hook ran in every forward, in none of the recomputes)


@pytest.mark.parametrize("form", list(POLICIES))
def test_a_gradient_penalty_inside_the_region(form: str) -> None:
    # autograd.grad inside the function recomputes while the forward runs and
    # is served from the cache, which keeps its outputs for the backward's
    # recompute; serving a view op's kept output twice made autograd refuse it
    # there ("Attempted to make a tensor into a differentiable view").
    def penalised(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = m(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y.sum() + (g.norm(dim=1) - 1).pow(2).mean()

    x = torch.randn(5, 8, requires_grad=True)
    assert_matches_plain(
        mlp(),
        x,
        lambda m, t: checkpoint(penalised, m, t, policy=POLICIES[form]),
        plain=penalised,
    )


@pytest.mark.parametrize("backward", ["inside", "after"])
def test_autocasts_weight_cache_does_not_stop_the_serving(backward: str) -> None:
    # Autocast caches weight casts within one autocast block: a second forward
    # there takes them from the cache while its recompute (backward after the
    # block) casts again, and a backward inside the block is the other way
    # round. Counted as ops, those casts shifted every later op's place, and
    # nothing after them was served.
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)]
    )
    x = torch.randn(4, 16, requires_grad=True)
    outputs, recomputed = [], []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):  # gradient accumulation: two forwards in one block
            y = checkpoint_sequential(model, 2, x, policy="compute_heavy")
            if backward == "inside":
                with OpCounter() as counter:
                    y.float().sum().backward()
                recomputed.append(counter.counts.get("addmm", 0))
            else:
                outputs.append(y)
    for y in outputs:
        with OpCounter() as counter:
            y.float().sum().backward()
        recomputed.append(counter.counts.get("addmm", 0))
    assert recomputed == [0, 0]  # every matmul was served


def test_random_ops_are_never_served_stale() -> None:
    # Keeping everything keeps dropout's mask too; a second backward (retain
    # graph) recomputes, with the same RNG, what the first one used up.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh())
    x = torch.randn(16, 8, requires_grad=True)
    torch.manual_seed(3)
    y = checkpoint(model, x, policy=lambda op, *a, **k: True)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    assert torch.equal(x.grad, 2 * first)
    x.grad = None
    torch.manual_seed(3)
    model(x).sum().backward()
    assert torch.equal(first, x.grad)


class DetachesAfterASavedTensor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.exp()  # saved: the recompute's hook detaches it
        b = (x * 3).detach()  # the forward's first detach
        return a * b


@pytest.mark.parametrize(
    "policy",
    [
        lambda op, *a, **k: op is torch.ops.aten.detach.default,
        [torch.ops.aten.detach],
        lambda op, *a, **k: True,
    ],
    ids=["callable", "ops", "everything"],
)
def test_a_policy_that_selects_detach_gets_right_gradients(policy: Any) -> None:
    # Detach is never kept or served (as in torch's selective checkpointing):
    # seqckpt's hooks detach in the recompute and not in the forward, so
    # counting it served the forward's b where the recompute detached a.
    assert_matches_plain(
        DetachesAfterASavedTensor(),
        torch.randn(5, requires_grad=True),
        lambda m, t: checkpoint(m, t, policy=policy),
    )


@pytest.mark.parametrize("keep", ["ours", "torch"])
def test_values_check_still_sees_a_changed_recompute_under_a_policy(keep: str) -> None:
    # The fingerprints are sums; a policy keeping sums must not keep them (or
    # the recompute is served the forward's and compares them with themselves).
    calls = [0]

    def drifting(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return (x * calls[0]).exp().sum(dim=0)

    def keeps_sums(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is torch.ops.aten.sum.dim_IntList

    extra: dict[str, Any]
    if keep == "ours":
        extra = {"policy": keeps_sums}
    else:
        from torch.utils.checkpoint import (
            CheckpointPolicy,
            create_selective_checkpoint_contexts,
        )

        def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            if keeps_sums(op):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        extra = {
            "context_fn": lambda: create_selective_checkpoint_contexts(torch_policy)
        }
    x = torch.randn(3, 4, requires_grad=True)
    y = checkpoint(drifting, x, determinism_check="values", **extra)
    with pytest.raises(seqckpt.CheckpointError, match="other values in the recompute"):
        y.sum().backward()


def _keep_clones_torch(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.aten.clone.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _torch_keeps_clones() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_clones_torch)


@pytest.mark.parametrize(
    "options",
    [
        {"policy": lambda op, *a, **k: True},
        {"policy": [torch.ops.aten.clone]},
        {"policy": lambda op, *a, **k: True, "determinism_check": "values"},
        {"context_fn": _torch_keeps_clones},
        {"context_fn": _torch_keeps_clones, "determinism_check": "values"},
        {"context_fn": TORCH_SAC},  # torch's SAC keeping the matmuls: failed too
    ],
    ids=[
        "everything",
        "clones",
        "everything-values",
        "torch-sac",
        "torch-sac-values",
        "torch-sac-heavy",
    ],
)
def test_buffer_bookkeeping_is_unseen_by_policies(options: dict[str, Any]) -> None:
    # The recompute puts BatchNorm's first-run statistics back with clone and
    # copy_; a policy's modes (ours or torch's) that counted those served the
    # model's own clone from the wrong call, or (torch's) raised in backward.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4), Copies(),
        nn.Linear(4, 4), nn.BatchNorm1d(4), Copies(),
    )  # fmt: skip
    assert_matches_plain(
        model,
        torch.randn(6, 4, requires_grad=True),
        lambda m, t: checkpoint(m, t, **options),
    )


def test_bookkeeping_is_hidden_only_from_the_modes_that_count_ops() -> None:
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _get_current_dispatch_mode_stack,
    )

    from seqckpt._state import unseen

    class Recording(TorchDispatchMode):  # type: ignore[misc]
        def __init__(self, counts: bool) -> None:
            super().__init__()
            self.counts_ops, self.ops = counts, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    below, counting, above = Recording(False), Recording(True), Recording(False)
    with below, counting, above:
        before = _get_current_dispatch_mode_stack()
        unseen(torch.ones(2).add, 1)
        assert _get_current_dispatch_mode_stack() == before  # same modes, same order
    add = torch.ops.aten.add.Tensor
    assert add in below.ops and add in above.ops  # a memory tracker still sees it
    assert add not in counting.ops


class SqueezeExcite(nn.Module):
    """torchvision EfficientNet's squeeze-and-excitation: a 1x1 convolution
    whose output an in-place SiLU overwrites."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(self.act(self.fc1(x.mean((2, 3), keepdim=True))))
        return scale.sigmoid() * x


@pytest.mark.parametrize("overwrite", ["silu_", "mul_", "out="])
def test_a_kept_output_changed_in_place_is_computed_again(overwrite: str) -> None:
    # Not relu_: serving the overwritten values and applying relu again gives
    # the same numbers, so it cannot tell a stale output from a fresh one.
    def block(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = m(x)  # kept: addmm
        if overwrite == "silu_":
            torch.nn.functional.silu(h, inplace=True)
        elif overwrite == "mul_":
            h[:, :3].mul_(3)  # through a view
        else:
            torch.sin(h.detach() * 2, out=h.detach())
        return h.sin()

    x = torch.randn(3, 6, requires_grad=True)
    assert_matches_plain(
        nn.Linear(6, 6),
        x,
        lambda m, t: checkpoint(block, m, t, policy="compute_heavy"),
        plain=block,
    )


@pytest.mark.parametrize("check", ["default", "values"])
@pytest.mark.parametrize("keep", ["everything", "all_but_batch_norm"])
def test_running_statistics_an_op_made_are_not_served_stale(
    check: str, keep: str
) -> None:
    # InstanceNorm(track_running_stats=True) repeats its buffers per sample and
    # batch norm updates the copies, without its schema saying so: a kept copy
    # was served updated to the recompute, which updated it again ("values"
    # raised), and a block reading the statistics got other values than in
    # forward (wrong gradients where batch norm itself was not kept).
    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        return keep == "everything" or op is not aten.native_batch_norm.default

    def block(h: torch.Tensor) -> torch.Tensor:
        mean, var = h.new_zeros(h.shape[1]) + 0, h.new_ones(h.shape[1]) * 1
        y = nn.functional.batch_norm(h, mean, var, training=True, momentum=0.5)
        return y * mean[:, None] + var[:, None]

    for model, run in (
        (nn.InstanceNorm1d(4, track_running_stats=True, affine=True), None),
        (nn.Linear(8, 8), lambda m, x: block(m(x))),
    ):
        x = torch.randn(2, 4, 8, requires_grad=True)
        call = run or (lambda m, x: m(x))
        assert_matches_plain(
            model,
            x,
            lambda m, x, call=call: checkpoint(
                call,
                m,
                x,
                policy=policy,
                determinism_check=check,
            ),
            plain=call,
        )


def test_batch_norm_in_training_is_not_kept() -> None:
    # it writes its running statistics: served, it would skip the write
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(3, 4)
    kept = {
        o.op
        for o in seqckpt.what_is_kept(model, x, policy=POLICIES["everything"]).outputs
    }
    assert "aten::addmm" in kept and "aten::native_batch_norm" not in kept
    model.eval()
    kept = {
        o.op
        for o in seqckpt.what_is_kept(model, x, policy=POLICIES["everything"]).outputs
    }
    assert "aten::native_batch_norm" in kept


@pytest.mark.parametrize(
    "options",
    [
        {"policy": "compute_heavy"},
        {"policy": lambda op, *args, **kwargs: True, "determinism_check": "values"},
    ],
    ids=["compute_heavy", "everything_values"],
)
def test_wrapper_subclass_tensors_under_a_policy(options: dict[str, Any]) -> None:
    # DTensor's case in one process (tests/test_distributed.py runs DTensor
    # itself): a wrapper subclass has no data pointer of its own, so which kept
    # output an in-place op wrote over, and the "values" fingerprints, must be
    # read through its inner tensors. It raised "invalid python storage".
    from torch.testing._internal.two_tensor import TwoTensor

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w  # kept
        h.mul_(3)  # written over what was kept
        return h.sin()

    def step(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = TwoTensor(torch.randn(4, 6), torch.randn(4, 6)).requires_grad_()
        w = TwoTensor(torch.randn(6, 6), torch.randn(6, 6)).requires_grad_()
        y = checkpoint(block, x, w, **options) if checkpointed else block(x, w)
        y.sum().backward()
        assert x.grad is not None and w.grad is not None
        return [t for u in (y.detach(), x.grad, w.grad) for t in (u.a, u.b)]

    for got, plain in zip(step(True), step(False), strict=True):
        assert torch.equal(got, plain)


def test_squeeze_excitation_under_compute_heavy_is_bitwise() -> None:
    torch.manual_seed(0)
    assert_matches_plain(
        SqueezeExcite(),
        torch.randn(2, 8, 4, 4, requires_grad=True),
        lambda m, t: checkpoint(m, t, policy="compute_heavy"),
    )


def test_policies_in_plans_print_and_round_trip_json() -> None:
    plan = Plan(
        (
            Recompute(0, 2, Plan((Run(0, 2),)), COMPUTE_HEAVY),
            Recompute(2, 4, Plan((Run(2, 4),)), ops(aten.mm, aten.bmm.default)),
            Recompute(4, 5, Plan((Run(4, 5),)), names("attn")),
            Run(5, 6),
        )
    )
    text = str(plan)
    assert "recompute 0-1 keeping compute_heavy" in text
    assert "keep(aten::bmm.default, aten::mm)" in text and "name:attn" in text
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert [getattr(i, "policy", None) for i in back.items] == [
        getattr(i, "policy", None) for i in plan.items
    ]
    with_callable = Plan((Recompute(0, 1, Plan((Run(0, 1),)), as_policy(keeps_gelu)),))
    with pytest.raises(ValueError, match="callable"):
        with_callable.to_json()


def test_checkpoint_sequential_applies_the_policy_to_every_segment() -> None:
    model = nn.Sequential(*[mlp() for _ in range(4)])
    x = torch.randn(6, 8, requires_grad=True)
    assert_matches_plain(
        model,
        x,
        lambda m, t: checkpoint_sequential(m, 3, t, policy="compute_heavy"),
    )
    wrapped = seqckpt.CheckpointedSequential(*model, segments=2, policy="compute_heavy")
    assert "policy=compute_heavy" in repr(wrapped)
    plan = seqckpt.executor.resolve_plan(3, list(model), COMPUTE_HEAVY)
    assert all(
        i.policy is COMPUTE_HEAVY for i in plan.items if isinstance(i, Recompute)
    )


@pytest.mark.parametrize(
    ("policy", "error", "pattern"),
    [
        ("fastest", ValueError, "argument 'policy'.*functools.partial"),
        (3, TypeError, "argument 'policy'"),
        # meant for the function (torch's checkpoint passes it on): a module is
        # callable and would pass for a callable policy
        (nn.Linear(2, 2), TypeError, "got a Linear. .*bind it first"),
        (nn.Sequential(nn.Linear(2, 2)), TypeError, "got a Sequential"),
        (torch.ones(2), TypeError, "got a Tensor"),
        ([3], TypeError, "aten ops"),
        (["addmm"], ValueError, "'aten::addmm'"),
    ],
)
def test_bad_policies(policy: object, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        checkpoint(torch.sin, torch.randn(2, requires_grad=True), policy=policy)


def test_policy_errors_name_the_conflict() -> None:
    from torch.utils.checkpoint import noop_context_fn

    def noop_context_fn2() -> Any:
        return noop_context_fn()

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="either 'policy' or 'context_fn'"):
        checkpoint(torch.sin, x, policy="compute_heavy", context_fn=noop_context_fn2)
    # torch's default context_fn, as wrappers pass it on, is no context_fn
    checkpoint(torch.sin, x, policy="compute_heavy", context_fn=noop_context_fn)
    plan = Plan((Recompute(0, 1, Plan((Run(0, 1),))), Run(1, 2)))
    with pytest.raises(ValueError, match="carries a policy per recomputed stretch"):
        checkpoint_sequential([torch.sin, torch.cos], plan, x, policy="compute_heavy")
    with pytest.raises(ValueError, match="planner chooses"):
        checkpoint_sequential(
            [torch.sin, torch.cos], "auto", x, policy="compute_heavy", memory_budget=10
        )


@pytest.mark.parametrize(
    ("tensor", "label", "pattern"),
    [
        ((torch.ones(2), torch.ones(2)), "out", "takes a tensor, got tuple"),
        (torch.ones(2), "", "non-empty string label"),
        (torch.ones(2), 3, "non-empty string label"),
    ],
)
def test_bad_names_are_refused(tensor: Any, label: Any, pattern: str) -> None:
    # a tuple (what an attention module returns) was named silently not at all
    with pytest.raises(TypeError, match=pattern):
        seqckpt.name(tensor, label)


def test_policy_objects() -> None:
    # one op given alone is that op (a packet iterates over its overload names,
    # an overload is callable: both were taken for something else)
    assert as_policy(aten.addmm) == ops(aten.addmm)
    assert as_policy(aten.addmm.default) == ops(aten.addmm.default)
    assert as_policy(["aten.addmm"]) == as_policy("aten::addmm") == ops(aten.addmm)
    assert as_policy("compute_heavy") is COMPUTE_HEAVY
    assert as_policy(None) is None
    assert Policy.from_json(COMPUTE_HEAVY.to_json()) is COMPUTE_HEAVY
    assert "aten::addmm" in COMPUTE_HEAVY.ops
    with pytest.raises(TypeError, match="non-empty strings"):
        names("")


def test_two_callables_are_two_policies_however_they_print() -> None:
    # Two lambdas print alike ("<lambda>"); as equal policies the profile
    # measured only the first and a plan could not tell them apart.
    first = as_policy(lambda op, *a, **k: op is aten.addmm.default)
    second = as_policy(lambda op, *a, **k: op is aten.gelu.default)
    assert str(first) == str(second) and first != second
    assert as_policy(keeps_gelu) == as_policy(keeps_gelu)
    assert as_policy(torch_keeps_gelu) == as_policy(torch_keeps_gelu)
    measured = seqckpt.profile(mlp(), torch.randn(6, 8), policies=[None, first, second])
    assert tuple(measured.policies) == (first, second)


class DrawThenDraw(nn.Module):
    """An out-of-place draw (stochastic depth's ``torch.rand``), named, then
    more draws from the same generator: dropout (default generator) or a
    second ``torch.rand`` (a generator of the module's own)."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.gen = torch.Generator().manual_seed(5) if own else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        noise = seqckpt.name(torch.rand(h.shape[0], 1, generator=self.gen), "draw")
        h = torch.tanh(h * (0.9 + noise).floor())
        if self.gen is None:
            return self.drop(h)
        return h * torch.rand(h.shape, generator=self.gen)


@pytest.mark.parametrize("own", [False, True], ids=["default_generator", "own"])
@pytest.mark.parametrize(
    "policy",
    [
        [aten.rand],
        lambda op, *a, **k: op is aten.rand.generator or op is aten.rand.default,
        lambda op, *a, **k: True,
        names("draw"),
    ],
    ids=["ops", "callable", "everything", "names"],
)
def test_a_kept_random_draw_leaves_its_generator_as_it_did(
    own: bool, policy: Any
) -> None:
    # Served instead of drawn again, a kept draw must still move its generator
    # on as it did in the forward; otherwise every later draw of the recompute
    # (dropout's mask) differs from the forward's: wrong gradients, no error
    # (torch's selective checkpointing does that).
    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(
        lambda: (torch.manual_seed(0), DrawThenDraw(own))[1],
        x,
        lambda m, t: checkpoint(m, t, policy=policy),
    )
    y = checkpoint(DrawThenDraw(own), x, policy=policy)
    with OpCounter() as counter:  # the kept draw is served, not drawn again
        y.sum().backward()
    # (a names policy keeps the named draw only: the module's second runs again)
    drawn_again = own and isinstance(policy, Policy) and bool(policy.names)
    assert counter.counts.get("rand", 0) == int(drawn_again)


@pytest.mark.cuda
def test_kept_cuda_dropout_leaves_the_philox_offset_as_it_did() -> None:
    # On CUDA dropout is one out-of-place op (native_dropout) drawing from the
    # device's Philox generator: kept and served, it must still move the
    # offset on, or the second dropout's recomputed mask is another one.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()
    ).cuda()
    x = torch.randn(16, 8, device="cuda", requires_grad=True)

    def step(policy: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        torch.manual_seed(1)
        y = model(x) if policy is None else checkpoint(model, x, policy=policy)
        y.sum().backward()
        return x.grad.clone(), torch.cuda.get_rng_state()

    plain = step(None)
    for policy in ([aten.native_dropout], lambda op, *a, **k: True):
        got = step(policy)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


# held by a global object: not found by the module walk, so not replayed
NOISE = types.SimpleNamespace(generator=torch.Generator())
GLOBAL_GENERATOR = NOISE.generator


def draws_from_a_global_generator(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * torch.rand(x.shape, generator=NOISE.generator))


def test_a_served_draw_leaves_a_generator_the_region_does_not_replay_alone() -> None:
    # A generator reached through a global object is not replayed (README): its draw,
    # kept, is served, and the caller's later draws from it are left as they are.
    x = torch.randn(3, 4, requires_grad=True)
    results = []
    for checkpointed in (False, True):
        GLOBAL_GENERATOR.manual_seed(0)
        x.grad = None
        if checkpointed:
            y = checkpoint(draws_from_a_global_generator, x, policy=[aten.rand])
        else:
            y = draws_from_a_global_generator(x)
        torch.rand(2, generator=GLOBAL_GENERATOR)  # the caller draws on
        y.sum().backward()
        results.append((x.grad.clone(), GLOBAL_GENERATOR.get_state()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.cuda
def test_kept_cuda_attention_with_dropout_leaves_the_philox_offset_as_it_did() -> None:
    # compute_heavy keeps fused attention; with dropout_p > 0 it draws from the
    # device's generator. Served, it must move the offset on, or the dropout
    # after it draws another mask in the recompute: "values" compares every
    # saved tensor of the recompute with the forward's (robust to the fused
    # kernels' nondeterministic backward).
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
            self.drop = nn.Dropout(0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(4, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
            return self.drop(self.out(a.transpose(1, 2).reshape(4, 16, 32)))

    block = Block().cuda()
    x = torch.randn(4, 16, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # a fused kernel's dtype
        y = checkpoint(block, x, policy="compute_heavy", determinism_check="values")
    y.float().sum().backward()  # raised CheckpointError before (another mask)
    assert x.grad is not None
