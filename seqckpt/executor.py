"""The one executor: :func:`run_plan` runs any plan tree over a chain with the
recompute primitive, and :func:`resolve_plan` turns every accepted form of
``segments`` (a count, a list of sizes, a plan) into a plan. Plans are built in
:mod:`seqckpt.planner` and here from ``segments``; they are run only here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from seqckpt._buffers import modules_of
from seqckpt.checkpoint import DEFAULT_OPTIONS, Options, run_region
from seqckpt.planner.tree import Plan, PlanError, Run, plan_from_sizes, uniform_plan

__all__ = ["resolve_plan", "run_plan"]


def resolve_plan(segments: object, chain: Sequence[Callable[[Any], Any]]) -> Plan:
    """Turn any accepted form of ``segments`` into a plan for ``chain``.

    An int ``k`` gives balanced segments whose checkpointed stretches never
    start at an item that writes into its input (``inplace=True``, as
    ``nn.ReLU(inplace=True)``): such a boundary moves to the next item, since a
    recompute would start from the overwritten values. Sizes and plans are
    taken as given.
    """
    n = len(chain)
    if isinstance(segments, Plan):
        try:
            segments.check(n)
        except PlanError as error:
            raise PlanError(
                str(error).replace("segments plan", "segments=plan")
            ) from None
        return segments
    if isinstance(segments, int) and not isinstance(segments, bool):
        if not 1 <= segments <= n:
            raise ValueError(
                f"seqckpt: segments must be between 1 and the number of modules "
                f"({n}), got segments={segments}."
            )
        return uniform_plan(n, segments, lambda i: _writes_its_input(chain[i]))
    if isinstance(segments, (list, tuple)):
        if not segments or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in segments
        ):
            raise TypeError(
                "seqckpt: segments given as sizes must be a non-empty list of ints, "
                f"got segments={segments!r}."
            )
        if any(s < 1 for s in segments) or sum(segments) != n:
            raise ValueError(
                f"seqckpt: segments sizes must be positive and sum to the number of "
                f"modules ({n}), got segments={list(segments)} "
                f"(sum {sum(segments)})."
            )
        return plan_from_sizes(list(segments))
    raise TypeError(
        "seqckpt: segments must be an int, a list of segment sizes, a Plan or "
        f"'auto', got {segments!r} ({type(segments).__name__})."
    )


def _writes_its_input(item: object) -> bool:
    return getattr(item, "inplace", False) is True


def run_plan(
    plan: Plan,
    modules: Sequence[Callable[[Any], Any]],
    input: Any,
    options: Options = DEFAULT_OPTIONS,
) -> Any:
    """Run ``modules`` on ``input`` following ``plan``: the one executor.

    A :class:`~seqckpt.planner.Run` item calls its modules in turn; a
    :class:`~seqckpt.planner.Recompute` item calls this function on its inner plan
    as one checkpointed region, so nested plans nest checkpoints.
    """
    x = input
    for item in plan.items:
        if isinstance(item, Run):
            for i in range(item.start, item.stop):
                x = modules[i](x)
        else:
            region = functools.partial(run_plan, item.inner, modules, options=options)
            runs = modules_of(tuple(modules[item.start : item.stop]))
            x = run_region(region, (x,), {}, options, runs)
    return x
