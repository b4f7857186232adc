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
"""

from __future__ import annotations

import math

import torch

from seqckpt.planner.budget import format_bytes
from seqckpt.planner.cost import CostModel
from seqckpt.planner.profile import ChainProfile
from seqckpt.planner.tree import Item, Plan, PlanError, Recompute, Run

__all__ = ["fastest_plan", "least_memory"]

DEFAULT_SLOTS = 400
# A tiny cost per checkpointed region, so that among equally fast plans the one
# with fewer regions wins.
_REGION_TIE_BREAK = 1e-9


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
    """The smallest peak any plan reaches under the cost model, and such a plan.

    Exact in bytes (no slots): ``M(i, last)`` is the least memory for layers
    ``i..last`` with the gradient of the output live. Ties go to the faster plan.
    """
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
                need = max(delta + nograd, model.a[j] + rest_need, inner_need)
                seconds = forward + rest_time + inner_time
                if (need, seconds) < candidate[:2]:
                    candidate = (need, seconds, j)
            best[i, last] = candidate

    return best[0, n - 1][0], Plan(_merge(_rebuild_least(best, 0, n - 1)))


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


def _solve(model: CostModel, budget: int, slots: int) -> Plan | None:
    """The DP on ``slots`` slots of ``budget / slots`` bytes (sizes rounded up, so
    a plan found always fits the budget); None when nothing fits."""
    n = len(model)
    unit = budget / slots
    inf = math.inf
    s_range = torch.arange(slots + 1)
    a = [_slots(x, unit) for x in model.a]
    kept = [_slots(x, unit) for x in model.kept]
    table = torch.full((n, n, slots + 1), inf, dtype=torch.float64)
    choice = torch.full((n, n, slots + 1), -1, dtype=torch.int32)
    a_tensor = torch.tensor(a)

    for d in range(n):
        for i in range(n - d):
            last = i + d
            delta = model.output_grad(last)
            base = model.forward_time[i] + model.backward_time[i]
            lower = max(
                _slots(delta + model.forward_peak[i], unit),
                _slots(model.held[i] + model.backward_peak[i], unit),
            )
            if d == 0:
                best = torch.where(s_range >= lower, base, inf)
                table[i, last] = best
                choice[i, last] = torch.where(torch.isfinite(best), 0, -1)
                continue
            keep = torch.full((slots + 1,), inf, dtype=torch.float64)
            if kept[i] <= slots:
                keep[kept[i] :] = base + table[i + 1, last, : slots + 1 - kept[i]]
            keep = torch.where(s_range >= lower, keep, inf)
            if not model.can_start[i]:
                table[i, last] = keep
                choice[i, last] = torch.where(torch.isfinite(keep), 0, -1)
                continue

            js = torch.arange(i + 1, last + 1)
            # rest j..last with x_j held: table[j, last, s - a_j]
            shift = s_range[None, :] - a_tensor[js][:, None]
            rest = table[js, last].gather(1, shift.clamp(min=0))
            rest = rest.masked_fill(shift < 0, inf)
            inner = table[i, js - 1]
            needs, forwards = [], []
            for _, forward, nograd in model.cuts(i, last):
                needs.append(_slots(delta + nograd, unit))
                forwards.append(forward + _REGION_TIE_BREAK)
            total = rest + inner + torch.tensor(forwards, dtype=torch.float64)[:, None]
            total = total.masked_fill(
                s_range[None, :] < torch.tensor(needs)[:, None], inf
            )
            ckpt, arg = total.min(dim=0)
            use_ckpt = ckpt < keep
            best = torch.where(use_ckpt, ckpt, keep)
            table[i, last] = best
            choice[i, last] = torch.where(
                torch.isfinite(best), torch.where(use_ckpt, js[arg], 0), -1
            )

    if not math.isfinite(float(table[0, n - 1, slots])):
        return None
    return Plan(_merge(_rebuild(choice.tolist(), kept, a, 0, n - 1, slots)))


def _rebuild(
    choices: list[list[list[int]]],
    kept: list[int],
    a: list[int],
    i: int,
    last: int,
    s: int,
) -> list[Item]:
    """The plan items the DP chose for layers ``i..last`` with ``s`` slots. (A
    module-level function: a recursive closure would be a reference cycle holding
    the whole table until the garbage collector runs.)"""
    items: list[Item] = []
    while True:
        c = choices[i][last][s]
        assert c >= 0, "the DP table led to an infeasible state"
        if c == 0:
            items.append(Run(i, i + 1))
            if i == last:
                return items
            s -= kept[i]
            i += 1
        else:
            inner = _rebuild(choices, kept, a, i, c - 1, s)
            items.append(Recompute(i, c, Plan(_merge(inner))))
            s -= a[c]
            i = c


def fastest_plan(
    profile: ChainProfile, budget: int | None, slots: int = DEFAULT_SLOTS
) -> Plan:
    """The fastest plan whose predicted peak fits ``budget`` bytes, with its
    ``predicted_peak_bytes`` and ``predicted_time`` filled in.

    ``budget=None`` keeps every activation (nothing is faster). Raises
    :class:`PlanError` naming the smallest feasible budget when none fits.
    """
    model = CostModel.of(profile)
    n = len(model)
    keep_all = Plan((Run(0, n),))
    plan: Plan | None = keep_all
    if budget is not None and model.total(keep_all.items)[0] > budget:
        plan = _solve(model, budget, slots)
    if plan is None:  # nothing fits, or rounding to slots lost the last bytes
        assert budget is not None
        floor, plan = least_memory(model)
        if floor > budget:
            raise PlanError(
                f"seqckpt: memory_budget={budget} bytes ({format_bytes(budget)}) is "
                f"below the smallest peak any plan reaches for this chain and input, "
                f"{floor} bytes ({format_bytes(floor)}); give at least that, or a "
                "smaller batch."
            )
    peak, seconds = model.total(plan.items)
    return Plan(plan.items, peak, seconds)
