"""The planner's cost model: how much time a plan takes and how much memory it
needs at its peak, from a :class:`~seqckpt.planner.profile.ChainProfile`.

Memory counts what the step allocates beyond the parameters, their gradients and
the input batch: activations kept for backward, activation gradients and
temporaries. A sub-chain ``i..l`` is always run with its input stored by the
caller and the gradient of its output (``a[l+1]`` bytes) counted as live (for
the whole chain's output, see :meth:`CostModel.output_grad`). The chain's
output itself stays alive until backward ends (whoever called the chain holds
it), so every backward and every recompute runs with it.

- keep layer ``i``, then the rest: the forward of ``i`` (gradient of the output
  live), the rest with layer ``i``'s saved bytes and output held, the backward
  of ``i`` with what it saved (output gradient included in its backward peak);
- recompute ``i..j-1``, then the rest: a forward of ``i..j-1`` that keeps
  nothing for backward, the rest with ``x_j`` held, then the inner plan of
  ``i..j-1`` with the gradient of ``x_j`` live. What the stretch's forward
  leaves alive even so is its layers' ``region_kept_bytes``, in two parts:
  the casts autocast's cache holds (``region_cast_bytes``: under
  ``torch.autocast`` with its cache on, a low-precision copy of every weight
  it casts), charged until the forward ends (the autocast block ends before
  backward in torch's recipe, and a recompute's own block when that
  recompute ends), and the rest (buffer copies a region keeps to replay,
  tensors a module stores on itself) charged until the stretch's recompute;
- recompute ``i..j-1`` under a policy (selective saving): its forward also keeps
  what the policy selects (in ``K``) and takes its measured time under the
  policy, and the recompute of the layers its inner plan runs plainly takes
  their measured recompute time instead of a full forward.

An activation that neither the layer making it nor the layer using it holds
(a linear layer's output before a ReLU or dropout, a frozen layer's before the
next) lives only through its consumer's forward: it is charged there (inside
that layer's forward peak, or as the input a checkpointed stretch starting
there holds), not to the layer or stretch that made it. Layers between them that
hand its storage on without holding it (a view, an in-place ReLU of a frozen
stem) are looked through.

So a plan's peak is the larger of two: its forward's, with the casts, and its
backward's, without them (:meth:`CostModel.phases`). The solver
(:mod:`seqckpt.planner.solver`) optimises exactly this model over plans whose
stretches with a policy recompute flat (their inner plan keeps every layer);
stretches without a policy may nest. Where there are casts, its dynamic program
is exact on two bounds of this model instead (:meth:`CostModel.bounds`), and the
plan is the fastest of theirs that fits under this one. Two smaller terms are
not seen by the dynamic program either: the buffer copies of stretches nested
in a recomputed stretch (:meth:`CostModel.nested_kept`, a few KiB per
BatchNorm) and the copy of the chain's output a recomputed last stretch makes
(:meth:`CostModel.phases`); every plan it gives is checked against this model,
so none is over the budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from seqckpt.planner.profile import ChainProfile
from seqckpt.planner.tree import Item, Plan, PlanError, Recompute, Run
from seqckpt.policies import Policy

__all__ = ["CostModel", "plan_cost"]


@dataclass(frozen=True)
class CostModel:
    """Per-layer figures the model needs, as plain lists.

    ``a[k]`` is the size of the input of layer ``k`` (``a[n]`` is the chain's
    output); the others are indexed by layer. ``can_start[k]`` is False where a
    checkpointed stretch must not begin: layer ``k`` writes into its input in
    place (or returns its input to a layer that does), so a recompute would
    start from modified values. ``policies[p]`` is a policy the profile measured
    (``policies[0]`` is None), ``kept_by[p][k]`` what layer ``k`` keeps under it
    from its forward to its recompute (for None its ``region_kept_bytes``;
    its output included when kept: ``output_kept_by[p][k]`` bytes, not kept
    again when the layer ends a stretch), ``cast_by[p][k]`` what it keeps
    besides until the forward ends (autocast's cached casts; for None its
    ``region_cast_bytes``), ``recompute_by[p][k]`` the seconds
    of its recompute under it and ``forward_by[p][k]`` those of its
    checkpointed forward under it (choosing what to keep costs time).
    ``shared_grads[k]`` is what the backward holds for the gradient sums of
    parameters several layers use while layer ``k``'s backward, or a
    recompute ending at it, runs (:attr:`LayerProfile.shared_grad_bytes`;
    part of ``backward_peak[k]`` and of :meth:`output_grad`).
    ``a_held[k]`` is what a stretch ending before layer ``k`` holds of its
    output while the rest runs (``a[k]``, or 0 where layer ``k`` does not keep
    its input: it lives only through that layer's forward, counted in its
    ``forward_peak``), and ``hold_in[k]`` what a stretch starting at layer
    ``k`` holds of its input besides (``a[k]`` where the layer before does not
    hold its output, else 0: the layer or stretch before holds it).
    """

    a: list[int]
    a_held: list[int]
    hold_in: list[int]
    kept: list[int]
    held: list[int]
    forward_peak: list[int]
    nograd_peak: list[int]
    backward_peak: list[int]
    forward_time: list[float]
    backward_time: list[float]
    can_start: list[bool]
    policies: list[Policy | None]
    kept_by: list[list[int]]
    cast_by: list[list[int]]
    output_kept_by: list[list[int]]
    recompute_by: list[list[float]]
    forward_by: list[list[float]]
    shared_grads: list[int]

    @staticmethod
    def of(profile: ChainProfile) -> CostModel:
        layers = profile.layers
        out = layers[-1].output_bytes
        n = len(layers)
        unsafe = [False] * (n + 1)
        for k in reversed(range(n)):
            p = layers[k]
            unsafe[k] = p.modifies_input or (p.returns_input and unsafe[k + 1])
        a = [layers[0].input_bytes] + [p.output_bytes for p in layers]
        # passing[k]: the input of layer k lives only through the forward of
        # the layer that takes it (neither that layer nor the one making it
        # holds it). Layers that hand their input's storage on unheld (a view,
        # or written in place without a graph: a frozen layer's in-place ReLU)
        # are looked through: the storage passes when the layer after them
        # does not hold it, and their output passes with their input.
        passing = [False] * (n + 1)
        for k in range(1, n):
            p = layers[k - 1]
            if p.returns_input:
                passing[k] = passing[k - 1] and not p.output_held
                continue
            taker = k
            while (
                taker < n - 1
                and layers[taker].returns_input
                and not layers[taker].output_held
            ):
                taker += 1
            q = layers[taker]
            passing[k] = not p.output_held and not (
                q.input_held or q.returns_input or q.modifies_input
            )
        return CostModel(
            a=a,
            a_held=[0 if passing[k] else a[k] for k in range(n + 1)],
            hold_in=[a[k] if passing[k] else 0 for k in range(n)],
            kept=[
                max(0, p.saved_bytes - a[k + 1]) if passing[k + 1] else p.saved_bytes
                for k, p in enumerate(layers)
            ],
            # The chain's output lives until backward ends (the caller holds
            # it, or the next layer saved it): every backward runs with it.
            # The last layer's backward holds it once, saved or not.
            held=[p.held_bytes + out for p in layers[:-1]] + [layers[-1].saved_bytes],
            forward_peak=[
                p.forward_peak_bytes + (a[k] if passing[k] else 0)
                for k, p in enumerate(layers)
            ],
            nograd_peak=[p.nograd_peak_bytes for p in layers],
            # (the gradient sums of shared parameters: held beside it)
            backward_peak=[p.backward_peak_bytes + p.shared_grad_bytes for p in layers],
            forward_time=[p.forward_time for p in layers],
            backward_time=[p.backward_time for p in layers],
            can_start=[not u for u in unsafe[:-1]],
            policies=[None, *profile.policies],
            kept_by=[[p.region_kept_bytes - p.region_cast_bytes for p in layers]]
            + [
                [p.policies[q].kept_bytes - p.policies[q].cast_bytes for p in layers]
                for q in range(len(profile.policies))
            ],
            cast_by=[[p.region_cast_bytes for p in layers]]
            + [
                [p.policies[q].cast_bytes for p in layers]
                for q in range(len(profile.policies))
            ],
            # (a passing output is not held by the stretch it ends: the
            # policy's copy is then the only one, and counts)
            output_kept_by=[[0] * n]
            + [
                [
                    p.output_bytes
                    if p.policies[q].keeps_output and not passing[k + 1]
                    else 0
                    for k, p in enumerate(layers)
                ]
                for q in range(len(profile.policies))
            ],
            recompute_by=[[p.forward_time for p in layers]]
            + [
                [p.policies[q].recompute_time for p in layers]
                for q in range(len(profile.policies))
            ],
            forward_by=[[p.forward_time for p in layers]]
            + [
                [p.forward_time_under(p.policies[q]) for p in layers]
                for q in range(len(profile.policies))
            ],
            shared_grads=[p.shared_grad_bytes for p in layers],
        )

    def stretch_kept(self, p: int, start: int, stop: int) -> int:
        """Bytes a stretch ``start..stop-1`` keeps under policy ``p`` until its
        recompute (its own output, held anyway, not counted)."""
        kept = sum(self.kept_by[p][k] for k in range(start, stop))
        return kept - self.output_kept_by[p][stop - 1]

    def stretch_cast(self, p: int, start: int, stop: int) -> int:
        """Bytes a stretch ``start..stop-1`` keeps under policy ``p`` until the
        forward it runs in ends (autocast's cached casts)."""
        return sum(self.cast_by[p][k] for k in range(start, stop))

    def nested_kept(self, items: tuple[Item, ...]) -> int:
        """What the stretches nested in an inner plan keep while the stretch
        holding them waits for its recompute: its forward runs them as regions
        too (as torch's nested checkpoints do), and each keeps its own copies
        of the buffers it writes until that recompute makes it anew (what a
        region without a policy keeps; what a policy keeps goes with the
        outer region's saved tensors)."""
        kept = 0
        for item in items:
            if isinstance(item, Recompute):
                kept += self.stretch_kept(0, item.start, item.stop)
                kept += self.nested_kept(item.inner.items)
        return kept

    def bounds(self) -> tuple[CostModel, ...]:
        """Models without casts (:attr:`cast_by` all 0) whose peaks bound this
        one's from both sides, for the dynamic program, which holds one memory
        figure per sub-chain where casts would need two (what the rest may use
        in its forward and in its backward): first the casts kept until the
        recompute (never below this model's peak), then the casts dropped
        (never above). Only the first where there are no casts."""
        if not any(any(row) for row in self.cast_by):
            return (self,)
        zero = [[0] * len(row) for row in self.cast_by]
        upper = replace(
            self,
            kept_by=[
                [k + c for k, c in zip(kept, cast, strict=True)]
                for kept, cast in zip(self.kept_by, self.cast_by, strict=True)
            ],
            cast_by=zero,
        )
        return (upper, replace(self, cast_by=zero))

    def policy_index(self, policy: Policy | None) -> int:
        """The index of ``policy`` among :attr:`policies`."""
        for i, known in enumerate(self.policies):
            if known == policy:
                return i
        raise PlanError(
            f"seqckpt: the plan recomputes under policy {policy}, which the profile "
            "did not measure; profile with seqckpt.profile(..., policies=[...]) "
            "including it."
        )

    def __len__(self) -> int:
        return len(self.kept)

    def output_grad(self, last: int) -> int:
        """Bytes live while a sub-chain ending at layer ``last`` runs beyond what
        it makes: the gradient of its output and, as it runs in the backward
        phase, the chain's output and the gradient sums of shared parameters
        (:attr:`shared_grads`). For the whole chain's end it is 0: the loss
        makes that gradient when backward starts, and the last layer's backward
        peak (measured with such a gradient made inside backward) counts it."""
        n = len(self)
        if last + 1 == n:
            return 0
        return self.a[last + 1] + self.a[n] + self.shared_grads[last]

    def total(self, items: tuple[Item, ...]) -> tuple[int, float]:
        """(peak bytes, seconds) of a whole-chain plan's items."""
        return self.cost(items, 0)

    def linear_terms(self) -> tuple[list[float], list[int]]:
        """The figures :meth:`linear_counts` counts. Times: the forward times,
        the backward times, then each policy's recompute times, then each
        policy's forward times. Bytes: what each layer keeps, what a stretch
        holds of its output (:attr:`a_held`) and of its input
        (:attr:`hold_in`), what each layer keeps recomputed under each policy
        (None first), the part of that which is its output (policies other
        than None), then the last layer's held bytes and backward peak."""
        n = len(self)
        return (
            [
                *self.forward_time,
                *self.backward_time,
                *(t for row in self.recompute_by[1:] for t in row),
                *(t for row in self.forward_by[1:] for t in row),
            ],
            [
                *self.kept,
                *self.a_held,
                *self.hold_in,
                *(b for row in self.kept_by for b in row),
                *(b for row in self.output_kept_by[1:] for b in row),
                self.held[n - 1],
                self.backward_peak[n - 1],
            ],
        )

    def linear_counts(self, items: tuple[Item, ...]) -> tuple[list[int], list[int]]:
        """Two counts of :meth:`linear_terms` for a whole-chain plan's
        ``items``, valid at any input size: how often it spends each time
        figure (its seconds, as :meth:`total` adds them up, are the dot
        product), and a floor under its peak (what its top-level items hold
        together while the last one's backward runs). With them the frontier
        ranks all its stored plans at a new size with two matrix products and
        computes the peaks of only the few that are faster and may fit."""
        n, policies = len(self), len(self.policies)
        seconds = [0] * (2 * n * policies)
        hold_in_at = 2 * n + 1  # where hold_in starts among the bytes
        kept_at = hold_in_at + n  # and kept_by's rows
        output_kept_at = kept_at + n * policies  # and output_kept_by[1:]'s
        floor = [0] * (output_kept_at + n * (policies - 1) + 2)

        # (items, at the top level); a stack, not a recursive closure (which
        # would be a reference cycle left to the garbage collector)
        pending: list[tuple[tuple[Item, ...], bool]] = [(items, True)]
        while pending:
            level, top = pending.pop()
            for item in level:
                if isinstance(item, Run):
                    for k in range(item.start, item.stop):
                        seconds[k] += 1
                        seconds[n + k] += 1
                        if top:
                            floor[k if k < n - 1 else len(floor) - 2] += 1
                    if top and item.stop == n:
                        floor[-1] += 1  # the last layer's backward peak
                    continue
                p = 0 if item.policy is None else self.policy_index(item.policy)
                # its forward keeping nothing (or what the policy selects)
                forward = 0 if p == 0 else n * (policies + p)
                for k in range(item.start, item.stop):
                    seconds[forward + k] += 1
                pending.append((item.inner.items, False))
                if top:  # its output and input, held, and what it keeps
                    if item.stop < n:
                        floor[n + item.stop] += 1
                    floor[hold_in_at + item.start] += 1
                    for k in range(item.start, item.stop):
                        floor[kept_at + n * p + k] += 1
                    if p:
                        floor[output_kept_at + n * (p - 1) + item.stop - 1] -= 1
                if p == 0:
                    continue
                for run in item.inner.items:  # recomputed under the policy
                    if isinstance(run, Run):
                        for k in range(run.start, run.stop):
                            seconds[k] -= 1
                            seconds[n * (1 + p) + k] += 1
        return seconds, floor

    def keep_alone(self, i: int, delta: int) -> int:
        """Bytes to run layer ``i`` kept, apart from what the rest needs."""
        return max(
            delta + self.forward_peak[i],
            self.held[i] + self.backward_peak[i],
        )

    def cuts(self, i: int, stop: int) -> Iterator[tuple[int, float, int]]:
        """For each ``j`` in ``i+1..stop``: ``j``, the seconds of the forward of
        layers ``i..j-1``, and the bytes of running them keeping nothing (the
        input of ``i`` not counted: its caller holds it). The solver walks these
        for every checkpoint it may cut at ``j``."""
        seconds, peak = 0.0, 0
        for j in range(i + 1, stop + 1):
            k = j - 1
            seconds += self.forward_time[k]
            peak = max(peak, (self.a[k] if k > i else 0) + self.nograd_peak[k])
            yield j, seconds, peak

    def cost(self, items: tuple[Item, ...], delta: int) -> tuple[int, float]:
        """(peak bytes, seconds) of ``items`` with ``delta`` bytes of output
        gradient live."""
        forward, backward, seconds = self.phases(items, delta)
        return max(forward, backward), seconds

    def phases(
        self, items: tuple[Item, ...], delta: int, last_stretch: bool = False
    ) -> tuple[int, int, float]:
        """The peak bytes of ``items``' forward and of their backward, and their
        seconds, with ``delta`` bytes of output gradient live. What a stretch
        keeps counts in both; its casts (:attr:`cast_by`) in the forward only.
        An inner plan runs in the backward: both its peaks count there. The
        inner plan of the chain's ``last_stretch`` runs with the gradient of
        the chain's output live through its forward, and its last layer with
        the chain's output held by the caller besides the copy it recomputes
        (a layer before counts that output in its ``delta`` and ``held``)."""
        n = len(self)
        caller = self.a[n] if last_stretch else 0
        fwd: int | None = None  # what the items after the current one need
        bwd = 0
        seconds = 0.0
        for item in reversed(items):
            if isinstance(item, Recompute):
                inner_fwd, inner_bwd, inner_time = self.phases(
                    item.inner.items,
                    self.output_grad(item.stop - 1),
                    last_stretch=item.stop == n,
                )
                *_, (_, forward, nograd) = self.cuts(item.start, item.stop)
                p = 0 if item.policy is None else self.policy_index(item.policy)
                held_in = self.hold_in[item.start]
                # what the region keeps without a policy (its buffer copies)
                # stays through its recompute and inner plan too
                copies = self.stretch_kept(0, item.start, item.stop)
                kept = copies if p == 0 else self.stretch_kept(p, item.start, item.stop)
                kept += held_in + self.nested_kept(item.inner.items)
                cast = self.stretch_cast(p, item.start, item.stop)
                if p:
                    forward = sum(
                        self.forward_by[p][k] for k in range(item.start, item.stop)
                    )
                    # layers the inner plan runs plainly are recomputed under
                    # the policy: their recompute time, not a full forward
                    inner_time -= sum(
                        self.forward_time[k] - self.recompute_by[p][k]
                        for run in item.inner.items
                        if isinstance(run, Run)
                        for k in range(run.start, run.stop)
                    )
                here_fwd = delta + nograd + kept + cast
                # an output the policy keeps lives through the recompute, which
                # does not make it again (served, or stopped before it)
                out_kept = self.output_kept_by[p][item.stop - 1]
                here_bwd = max(inner_fwd + out_kept, inner_bwd) + held_in + copies
                if fwd is not None:
                    out = self.a_held[item.stop] + kept
                    here_fwd = max(here_fwd, out + cast + fwd)
                    here_bwd = max(here_bwd, out + bwd)
                fwd, bwd = here_fwd, here_bwd
                seconds += forward + inner_time
                continue
            for i in reversed(range(item.start, item.stop)):
                here_fwd = delta + self.forward_peak[i]
                here_bwd = self.held[i] + self.backward_peak[i]
                if i == n - 1:
                    here_fwd += caller
                    here_bwd += caller
                if fwd is not None:
                    here_fwd = max(here_fwd, self.kept[i] + fwd)
                    here_bwd = max(here_bwd, self.kept[i] + bwd)
                fwd, bwd = here_fwd, here_bwd
                seconds += self.forward_time[i] + self.backward_time[i]
        assert fwd is not None
        return fwd + caller, bwd, seconds


def plan_cost(plan: Plan, profile: ChainProfile) -> tuple[int, float]:
    """Predicted (peak bytes, step seconds) of ``plan`` on the profiled chain.

    Example:
        >>> import torch, seqckpt
        >>> from seqckpt.planner import uniform_plan, plan_cost
        >>> chain = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> prof = seqckpt.profile(chain, torch.randn(32, 64), repeats=1)
        >>> keep_all, two = uniform_plan(4, 1), uniform_plan(4, 2)
        >>> plan_cost(two, prof)[0] < plan_cost(keep_all, prof)[0]
        True
    """
    plan.check(len(profile))
    model = CostModel.of(profile)
    return model.total(plan.items)
