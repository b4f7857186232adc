"""The solver: the fastest plan under a memory budget, by the persistent-schedule
dynamic program of Beaumont, Eyraud-Dubois, Herrmann, Joly and Shilova
("Optimal checkpointing for heterogeneous chains", 2019), on the cost model of
:mod:`seqckpt.planner.cost`.

``C(i, last, s)`` is the least time to run layers ``i..last`` forward and backward with
``s`` memory slots. Either layer ``i`` is kept (its saved bytes stay while the
rest runs) or ``i..j-1`` is checkpointed (``x_j`` stays while ``j..last`` runs, then
``i..j-1`` is recomputed with all ``s`` slots and its own best inner schedule).
Each choice becomes an item of the plan tree: keep is a :class:`Run`, checkpoint
is a :class:`Recompute` whose inner plan is the solution of ``C(i, j-1, s)``.
The table is vectorised over slots with torch, so 100 layers take about a second.
Under autocast, whose cached casts the cost model charges through the forward
only, the table is filled twice, on the model's two bounds
(:meth:`~seqckpt.planner.cost.CostModel.bounds`), and the fastest plan of either
that fits the model itself is taken: not always the optimum of that model.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from seqckpt.planner.budget import format_bytes
from seqckpt.planner.coarse import coarsen, expand
from seqckpt.planner.cost import CostModel
from seqckpt.planner.profile import ChainProfile
from seqckpt.planner.tree import Item, Plan, PlanError, Recompute, Run

__all__ = ["fastest_plan", "frontier_plans", "least_memory", "smallest_peak"]

DEFAULT_SLOTS = 400
# Longer chains are planned on this many groups of adjacent layers.
EXACT_LAYERS = 100
# A tiny cost per checkpointed region of L layers: _REGION_TIE_BREAK times a
# layer's mean step time times L * L / n (n layers). It is positive, so no
# region is added where it buys nothing, and at most 1e-4 of a step over a
# whole plan; among equally fast plans it prefers the one whose recomputed
# stretches are shortest, whose recompute and backward run in a smaller
# working set (on 8 GPT blocks on a CPU, two 2-block stretches ran 2-3%
# faster than one 4-block stretch recomputing the same blocks).
_REGION_TIE_BREAK = 1e-4


def _merge(items: list[Item]) -> tuple[Item, ...]:
    """Adjacent Run items become one."""
    out: list[Item] = []
    for item in items:
        if out and isinstance(item, Run) and isinstance(out[-1], Run):
            out[-1] = Run(out[-1].start, item.stop)
        else:
            out.append(item)
    return tuple(out)


def least_memory(model: CostModel) -> tuple[int, Plan]:
    """The smallest peak a plan reaches under the cost model, and such a plan.

    Exact in bytes (no slots): ``M(i, last)`` is the least memory for layers
    ``i..last`` with the gradient of the output live. Ties go to the faster plan.
    Where the model has casts, the least of its two bounds' plans
    (:meth:`CostModel.bounds`), which may be above the exact least.
    """
    found = []
    for bound in model.bounds():
        plan = _least_memory(bound)
        need, seconds = model.total(plan.items)
        found.append((need, seconds, plan))
    need, _, plan = min(found, key=lambda f: f[:2])
    return need, plan


def _least_memory(model: CostModel) -> Plan:
    n = len(model)
    best: dict[tuple[int, int], tuple[int, float, int]] = {}  # need, time, choice
    for d in range(n):
        for i in range(n - d):
            last = i + d
            delta = model.output_grad(last)
            f = model.forward_time[i]
            keep_time = f + model.backward_time[i]
            if d == 0:
                best[i, last] = (model.keep_alone(i, delta), keep_time, 0)
                continue
            rest_need, rest_time, _ = best[i + 1, last]
            candidate = (
                max(model.keep_alone(i, delta), model.kept[i] + rest_need),
                keep_time + rest_time,
                0,
            )
            for j, forward, nograd in model.cuts(i, last) if model.can_start[i] else ():
                rest_need, rest_time, _ = best[j, last]
                inner_need, inner_time, _ = best[i, j - 1]
                held_in = model.hold_in[i]
                kept = model.stretch_kept(0, i, j) + held_in
                need = max(
                    delta + nograd + kept,
                    model.a_held[j] + kept + rest_need,
                    inner_need + kept,  # (its buffer copies, through it)
                )
                seconds = forward + rest_time + inner_time
                if (need, seconds) < candidate[:2]:
                    candidate = (need, seconds, j)
            best[i, last] = candidate

    return Plan(_merge(_rebuild_least(best, 0, n - 1)))


def _rebuild_least(
    best: dict[tuple[int, int], tuple[int, float, int]], i: int, last: int
) -> list[Item]:
    items: list[Item] = []
    while True:
        choice = best[i, last][2]
        if choice == 0:
            items.append(Run(i, i + 1))
            if i == last:
                return items
            i += 1
        else:
            inner = Plan(_merge(_rebuild_least(best, i, choice - 1)))
            items.append(Recompute(i, choice, inner))
            i = choice


def _slots(nbytes: int, unit: float) -> int:
    return math.ceil(nbytes / unit)


def _ceil_slots(nbytes: torch.Tensor, unit: float) -> torch.Tensor:
    return torch.ceil(nbytes / unit).to(torch.int64)


class _Tables:
    """The per-stretch figures the DP reads, as tensors over (i, j): the
    stretch of layers ``i..j-1``."""

    def __init__(self, model: CostModel) -> None:
        n = len(model)
        f64 = torch.float64
        self.a_held = torch.tensor(model.a_held, dtype=f64)
        self.hold_in = torch.tensor(model.hold_in, dtype=f64)
        self.kept = torch.tensor(model.kept, dtype=f64)
        self.forward_peak = torch.tensor(model.forward_peak, dtype=f64)
        self.held = torch.tensor(model.held, dtype=f64)
        self.backward_peak = torch.tensor(model.backward_peak, dtype=f64)
        self.step = torch.tensor(
            [f + b for f, b in zip(model.forward_time, model.backward_time)],  # noqa: B905
            dtype=f64,
        )
        self.delta = torch.tensor(
            [model.output_grad(last) for last in range(n)], dtype=f64
        )
        self.can_start = torch.tensor(model.can_start)

        def prefix(values: list[float] | list[int]) -> torch.Tensor:
            return torch.cat(
                (torch.zeros(1, dtype=f64), torch.tensor(values, dtype=f64).cumsum(0))
            )

        self.F = prefix(model.forward_time)
        self.B = prefix(model.backward_time)
        self.R = [prefix(r) for r in model.recompute_by]
        self.PF = [prefix(f) for f in model.forward_by]
        self.K = [prefix(k) for k in model.kept_by]
        self.OK = [torch.tensor(k + [0], dtype=f64) for k in model.output_kept_by]
        # nograd[i, j]: bytes of running i..j-1 keeping nothing (input of i not
        # counted); flat_forward[i, j] and flat_backward[i, j]: bytes of the
        # forward and of the backward of keeping every layer of i..j-1 with the
        # gradient of x_j live (the recompute of a stretch under a policy, run
        # in the backward phase), flat[i, j] the larger.
        # Built in Python lists, then one tensor each (element writes into a
        # tensor cost microseconds each).
        nograd = [[0.0] * (n + 1) for _ in range(n)]
        flat_forward = [[0.0] * (n + 1) for _ in range(n)]
        flat_backward = [[0.0] * (n + 1) for _ in range(n)]
        for i in range(n):
            row = nograd[i]
            for j, _, stretch_peak in model.cuts(i, n):
                row[j] = stretch_peak
        for j in range(1, n + 1):
            delta = model.output_grad(j - 1)
            forward = backward = 0
            for i in reversed(range(j)):
                here_forward = delta + model.forward_peak[i]
                here_backward = model.held[i] + model.backward_peak[i]
                if i < j - 1:
                    here_forward = max(here_forward, model.kept[i] + forward)
                    here_backward = max(here_backward, model.kept[i] + backward)
                forward, backward = here_forward, here_backward
                flat_forward[i][j], flat_backward[i][j] = forward, backward
        self.nograd = torch.tensor(nograd, dtype=f64)
        self.flat_forward = torch.tensor(flat_forward, dtype=f64)
        self.flat_backward = torch.tensor(flat_backward, dtype=f64)
        self.flat = torch.maximum(self.flat_forward, self.flat_backward)


class _Shift:
    """Reads ``table[..., s - shift]`` for every slot ``s`` of tables of one
    shape, the index made once for all of them."""

    def __init__(self, like: torch.Tensor, shift: torch.Tensor) -> None:
        index = torch.arange(like.shape[-1]).expand_as(like) - shift.unsqueeze(-1)
        self.below = index < 0
        self.index = index.clamp_(min=0)

    def times(self, table: torch.Tensor) -> torch.Tensor:
        """The shifted times (inf where ``s - shift`` is below 0)."""
        return table.gather(-1, self.index).masked_fill_(self.below, math.inf)

    def bytes(self, table: torch.Tensor) -> torch.Tensor:
        """The shifted bytes (meaningless where the times are inf)."""
        return table.gather(-1, self.index)


def _solve(model: CostModel, budget: int, slots: int) -> Plan | None:
    """The fastest plan whose exact peak fits ``budget``, from the DP on each
    of the model's bounds (:meth:`CostModel.bounds`); None when nothing fits."""
    bounds = model.bounds()
    found = [
        # (the upper bound's bytes are above the model's: not a filter)
        _solve_bound(bound, model, budget, slots, exact=k == len(bounds) - 1)
        for k, bound in enumerate(bounds)
    ]
    plans = [(model.total(p.items)[1], p) for p in found if p is not None]
    return min(plans, key=lambda f: f[0])[1] if plans else None


def _solve_bound(
    bound: CostModel, model: CostModel, budget: int, slots: int, exact: bool
) -> Plan | None:
    """The DP on ``bound``, on slots of ``budget / slots`` bytes.

    Sizes are rounded up to whole slots, so the plan at ``slots`` fits the
    budget, but a faster plan whose exact peak fits may need a few slots more
    once rounded (at most one per term of its peak: fewer than ``n + 3``; a
    torch ``checkpoint_sequential`` plan at exactly its own peak is one). The
    table runs on ``n + 3`` slots more of the same size, and from its top
    down the first plan whose exact peak under ``model`` fits the budget is
    taken: at ``slots`` at the latest when ``bound`` is the model or above
    it, unless what the DP does not see (:meth:`CostModel.nested_kept`) puts
    that plan over; the walk then goes on down, as it does on the bound
    below the model (casts dropped). With ``exact`` (``bound`` is the model
    or below it), the whole chain's choices are also held to the budget in
    bytes: a faster plan over the budget by less than its rounding would
    otherwise hide, at every number of slots, a slower one that fits."""
    n = len(model)
    unit = budget / slots
    top = slots + n + 3
    T, C = _table(bound, unit * top, top, budget if exact else None)
    choices = _Choices(C)
    times = T[0, n - 1].tolist()
    previous: tuple[Item, ...] = ()
    found: Plan | None = None
    fastest = math.inf
    # Times grow as slots shrink, except with ``exact``: a greedier plan over
    # the budget may fill more slots than a leaner, faster one that fits. So
    # every step down is looked at that is faster than the plan found.
    for s in range(top, -1, -1):
        if not times[s] < fastest:  # infeasible, or no faster
            continue
        plan = _plan_at(choices, bound, unit * top, top, s)
        if plan.items == previous:
            continue
        previous = plan.items
        if model.total(plan.items)[0] <= budget:
            found, fastest = plan, times[s]
    return found


def frontier_plans(
    model: CostModel, budget: int, slots: int = DEFAULT_SLOTS
) -> list[Plan]:
    """The fastest plan for every budget up to ``budget``, from one solve per
    bound of the model (:meth:`CostModel.bounds`): the table holds the least
    time for each number of slots, and each step down that staircase is
    another plan (the first one the least memory the slots can express, the
    last one the fastest within ``budget``)."""
    n = len(model)
    plans: list[Plan] = []
    known: set[tuple[Item, ...]] = set()
    for bound in model.bounds():
        T, C = _table(bound, budget, slots)
        choices = _Choices(C)
        previous = math.inf
        for s, value in enumerate(T[0, n - 1].tolist()):
            if math.isfinite(value) and value < previous:
                plan = _plan_at(choices, bound, budget, slots, s)
                previous = value
                if plan.items not in known:
                    known.add(plan.items)
                    plans.append(plan)
    return plans


class _Choices:
    """The DP's choices, read entry by entry as plans are rebuilt: each row
    ``(i, last)`` becomes a list once (indexing the tensor itself costs about
    a microsecond an entry)."""

    def __init__(self, C: torch.Tensor) -> None:
        self.C = C
        self.rows: dict[tuple[int, int], list[int]] = {}

    def at(self, i: int, last: int, s: int) -> int:
        row = self.rows.get((i, last))
        if row is None:
            row = self.rows[i, last] = self.C[i, last].tolist()
        return row[s]


def _plan_at(
    choices: _Choices, model: CostModel, budget: float, slots: int, s: int
) -> Plan:
    unit = budget / slots
    a = [_slots(x, unit) for x in model.a_held]
    kept_slots = [_slots(x, unit) for x in model.kept]
    return Plan(
        _merge(_rebuild(choices, model, kept_slots, a, unit, 0, len(model) - 1, s))
    )


class _Cuts(NamedTuple):
    """One kind of cut the DP weighs for a diagonal's stretches (see
    :func:`_table`): for each stretch (row) and cut (column) the layer it cuts
    at, the stretch's first layer, the bytes it keeps and their slots, the
    bytes it needs alone; the last layers of the rows; whether the stretch
    runs an inner plan (no policy)."""

    cut: torch.Tensor
    first: torch.Tensor
    kept: torch.Tensor
    kept_slots: torch.Tensor
    alone: torch.Tensor
    lasts: torch.Tensor
    inner: bool

    def bytes(
        self, N: torch.Tensor, Nx: torch.Tensor, column: torch.Tensor
    ) -> torch.Tensor:
        """The bytes of the plans that cut at ``column`` (for each row and
        slot, or broadcast over the columns) given the sub-plans' bytes in
        ``N`` and, after a cut with its input held, in ``Nx``."""
        row = torch.arange(len(self.cut)).view(-1, *[1] * (column.dim() - 1))
        j = self.cut[row, column]
        rest = torch.arange(N.shape[-1]) - self.kept_slots[row, column]
        rest.clamp_(min=0)  # (below 0 the time is inf: these bytes go unread)
        found = Nx[j, self.lasts[row], rest]
        if self.inner:
            found = torch.maximum(found, N[self.first[row, column], j - 1, rest])
        found += self.kept[row, column].to(found.dtype)
        return torch.maximum(found, self.alone[row, column].to(found.dtype))


def _table(
    model: CostModel, budget: float, slots: int, exact: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DP table and its choices (see :func:`_solve`).

    ``T[i, last, s]`` is the least time for layers ``i..last`` in ``s`` slots; its
    choice is 0 (keep layer ``i``) or ``p * (n + 1) + j``: checkpoint ``i..j-1``
    under policy ``p`` (0: none, its inner plan itself optimal; else a flat
    recompute). Among equally fast choices the one whose plan needs the
    fewest bytes (``N``, the exact peak of the sub-plan chosen) is taken: the
    rounding to slots cannot tell two such plans apart, and where the walk
    down the table rejects the one it was shown, the other is then never
    shown (equal blocks make such ties common). With ``exact``, the whole
    chain's choices (the top entry) whose plan needs more bytes than that are
    left out. One diagonal ``last - i = d`` is computed at a time, all its
    stretches at once, so the Python loop runs ``n`` times.
    """
    n = len(model)
    unit = budget / slots
    tables = _Tables(model)
    inf = math.inf
    width = slots + 1
    s_range = torch.arange(width)
    dtype = torch.float32  # half the memory traffic of float64; times to ~1e-7
    T = torch.full((n, n, width), inf, dtype=dtype)
    N = torch.full((n, n, width), inf, dtype=dtype)
    # Tx[j, last, s] = T[j, last, s - a_j]: the rest after a cut at j, with x_j
    # held, made once per entry instead of once per stretch that cuts at j;
    # Nx likewise, with x_j's bytes added.
    Tx = torch.full((n, n, width), inf, dtype=dtype)
    Nx = torch.full((n, n, width), inf, dtype=dtype)
    C = torch.full((n, n, width), -1, dtype=torch.int32)
    tie = _REGION_TIE_BREAK * max(1e-12, float(tables.step.mean())) / n
    a_slots = _ceil_slots(tables.a_held, unit)
    policies = len(model.policies)

    for d in range(n):
        starts = torch.arange(n - d)
        lasts = starts + d
        delta = tables.delta[lasts]
        alone = torch.maximum(
            delta + tables.forward_peak[starts],
            tables.held[starts] + tables.backward_peak[starts],
        )
        allowed = s_range[None, :] >= _ceil_slots(alone, unit)[:, None]
        base = tables.step[starts].to(dtype)[:, None]
        alone_bytes = alone.to(dtype)[:, None]
        if d == 0:
            best = torch.where(allowed, base, inf)
            best_need = torch.where(allowed, alone_bytes, inf)
        else:
            shift = _ceil_slots(tables.kept[starts], unit)
            rest_times = T[starts + 1, lasts]
            shifted = _Shift(rest_times, shift)
            rest = shifted.times(rest_times)
            best = torch.where(allowed, rest + base, inf)
            rest_need = shifted.bytes(N[starts + 1, lasts])
            rest_need += tables.kept[starts].to(dtype)[:, None]
            best_need = torch.where(allowed, torch.maximum(alone_bytes, rest_need), inf)
        limit = exact if d == n - 1 else None  # the whole chain's entry
        if limit is not None:
            best.masked_fill_(best_need > limit, inf)
        code = torch.zeros_like(best, dtype=torch.int32)
        startable = tables.can_start[starts]
        if d > 0 and bool(startable.any()):
            cuts = starts[:, None] + torch.arange(1, d + 1)[None, :]
            firsts = starts[:, None].expand_as(cuts)
            after = Tx[cuts, lasts[:, None].expand_as(cuts)]  # (stretches, d, slots)
            forward = tables.F[cuts] - tables.F[firsts]
            ties = tie * (cuts - firsts).to(torch.float64) ** 2
            nograd = tables.nograd[firsts, cuts]
            flat = tables.flat[firsts, cuts]
            # the stretch's input, where nothing before it holds it
            held_in = tables.hold_in[firsts]
            # what a region leaves alive without a policy (buffer copies, and
            # in the upper bound autocast's casts) stays through its inner
            # plan too
            copies = tables.K[0][cuts] - tables.K[0][firsts]
            for p in range(policies):
                if p == 0:  # no policy: the inner stretch solved optimally
                    c, f = cuts, firsts
                    kept = copies + held_in
                    kept_slots = _ceil_slots(kept, unit)
                    shifted = _Shift(after, kept_slots)
                    total = shifted.times(after)
                    total += shifted.times(T[firsts, cuts - 1])
                    total += (forward + ties).to(dtype)[..., None]
                    alone_here = delta[:, None] + nograd + kept
                else:  # a flat recompute under the policy, holding what it keeps
                    # Stretches too long to recompute flat in the budget are
                    # left out (flat needs grow with the stretch's length).
                    fits = (flat <= budget).any(dim=0).nonzero()
                    if len(fits) == 0:
                        continue
                    m = int(fits.max()) + 1
                    c, f = cuts[:, :m], firsts[:, :m]
                    kept = tables.K[p][c] - tables.K[p][f] - tables.OK[p][c - 1]
                    kept += held_in[:, :m]
                    # an output the policy keeps lives through the recompute
                    recompute = torch.maximum(
                        tables.flat_forward[f, c] + tables.OK[p][c - 1],
                        tables.flat_backward[f, c],
                    )
                    recompute += held_in[:, :m] + copies[:, :m]
                    seconds = tables.PF[p][c] - tables.PF[p][f]
                    seconds += tables.R[p][c] - tables.R[p][f]
                    seconds += tables.B[c] - tables.B[f] + ties[:, :m]
                    kept_slots = _ceil_slots(kept, unit)
                    shifted = _Shift(after[:, :m], kept_slots)
                    total = shifted.times(after[:, :m])
                    total += seconds.to(dtype)[..., None]
                    alone_here = torch.maximum(
                        delta[:, None] + nograd[:, :m] + kept, recompute
                    )
                total.masked_fill_(
                    s_range < _ceil_slots(alone_here, unit)[..., None], inf
                )

                group = _Cuts(c, f, kept, kept_slots, alone_here, lasts, p == 0)
                if limit is not None:  # one stretch: every cut held to it
                    every = group.bytes(N, Nx, torch.arange(c.shape[1])[None, :, None])
                    total.masked_fill_(every > limit, inf)
                    ckpt = total.min(dim=1, keepdim=True).values
                    # of the fastest cuts the one needing the fewest bytes
                    cut = every.masked_fill_(total != ckpt, inf).min(dim=1).indices
                    ckpt = ckpt.squeeze(1)
                else:
                    ckpt, cut = total.min(dim=1)  # (stretches, slots)
                ckpt_need = group.bytes(N, Nx, cut)
                ckpt.masked_fill_(~startable[:, None], inf)
                # equally fast: the plan needing fewer bytes (the rounding to
                # slots cannot tell them apart; where the walk down the table
                # rejects the one it is shown, the other would stay hidden)
                use = (ckpt < best) | ((ckpt == best) & (ckpt_need < best_need))
                use &= torch.isfinite(ckpt)
                best = torch.where(use, ckpt, best)
                best_need = torch.where(use, ckpt_need, best_need)
                code = torch.where(
                    use, (p * (n + 1) + starts[:, None] + 1 + cut).to(torch.int32), code
                )
        T[starts, lasts] = best
        N[starts, lasts] = best_need
        shifted = _Shift(best, a_slots[starts])
        Tx[starts, lasts] = shifted.times(best)
        Nx[starts, lasts] = (
            shifted.bytes(best_need) + tables.a_held[starts].to(dtype)[:, None]
        )
        C[starts, lasts] = torch.where(torch.isfinite(best), code, -1)
    return T, C


def _rebuild(
    choices: _Choices,
    model: CostModel,
    kept: list[int],
    a: list[int],
    unit: float,
    i: int,
    last: int,
    s: int,
) -> list[Item]:
    """The plan items the DP chose for layers ``i..last`` with ``s`` slots. (A
    module-level function: a recursive closure would be a reference cycle holding
    the whole table until the garbage collector runs.)"""
    n = len(model)
    items: list[Item] = []
    while True:
        c = choices.at(i, last, s)
        assert c >= 0, "the DP table led to an infeasible state"
        if c == 0:
            items.append(Run(i, i + 1))
            if i == last:
                return items
            s -= kept[i]
            i += 1
            continue
        p, j = divmod(c, n + 1)
        held_in = model.hold_in[i]
        if p == 0:
            stretch_kept = model.stretch_kept(0, i, j) + held_in
            inner_slots = s - _slots(stretch_kept, unit)
            inner = _rebuild(choices, model, kept, a, unit, i, j - 1, inner_slots)
            items.append(Recompute(i, j, Plan(_merge(inner))))
            s -= a[j] + _slots(stretch_kept, unit)
        else:
            stretch_kept = model.stretch_kept(p, i, j) + held_in
            items.append(Recompute(i, j, Plan((Run(i, j),)), model.policies[p]))
            s -= a[j] + _slots(stretch_kept, unit)
        i = j


def smallest_peak(
    profile: ChainProfile, exact_up_to: int = EXACT_LAYERS
) -> tuple[int, Plan]:
    """The smallest peak a plan reaches (exactly up to ``exact_up_to`` layers,
    on groups of layers beyond) and such a plan."""
    model = CostModel.of(profile)
    n = len(model)
    if n <= exact_up_to:
        return least_memory(model)
    coarse, starts = coarsen(profile, exact_up_to, model.can_start)
    _, plan = least_memory(CostModel.of(coarse))
    plan = expand(plan, starts, n)
    return model.total(plan.items)[0], plan


def fastest_plan(
    profile: ChainProfile,
    budget: int | None,
    slots: int = DEFAULT_SLOTS,
    exact_up_to: int = EXACT_LAYERS,
) -> Plan:
    """The fastest plan whose predicted peak fits ``budget`` bytes, with its
    ``predicted_peak_bytes`` and ``predicted_time`` filled in.

    ``budget=None`` keeps every activation (nothing is faster). Raises
    :class:`PlanError` naming the smallest feasible budget when none fits.
    Chains longer than ``exact_up_to`` layers are planned on groups of adjacent
    cheap layers (see :mod:`seqckpt.planner.coarse`); the predictions are then
    those of the expanded plan on the layers.
    """
    model = CostModel.of(profile)
    n = len(model)
    keep_all = Plan((Run(0, n),))
    plan: Plan | None = keep_all
    groups: tuple[CostModel, list[int]] | None = None
    if n > exact_up_to:
        coarse, starts = coarsen(profile, exact_up_to, model.can_start)
        groups = (CostModel.of(coarse), starts)
    if budget is not None and model.total(keep_all.items)[0] > budget:
        if groups is None:
            plan = _solve(model, budget, slots)
        else:
            found = _solve(groups[0], budget, slots)
            plan = None if found is None else expand(found, groups[1], n)
            if plan is not None and model.total(plan.items)[0] > budget:
                plan = None  # the groups' estimate was optimistic: fall through
    if plan is None:  # nothing fits, or rounding to slots lost the last bytes
        assert budget is not None
        floor, plan = smallest_peak(profile, exact_up_to)
        if floor > budget:
            raise PlanError(
                f"seqckpt: memory_budget={budget} bytes ({format_bytes(budget)}) is "
                f"below the smallest peak of the plans found for this chain and "
                f"input, {floor} bytes ({format_bytes(floor)}); give at least that, "
                "or a smaller batch."
            )
    peak, seconds = model.total(plan.items)
    return Plan(plan.items, peak, seconds)
