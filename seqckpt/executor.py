"""The one executor: :func:`run_plan` runs any plan tree over a chain with the
recompute primitive, and :func:`resolve_plan` turns every accepted form of
``segments`` (a count, a list of sizes, a plan) into a plan. Plans are built in
:mod:`seqckpt.planner` and here from ``segments``; they are run only here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqckpt._buffers import modules_of
from seqckpt._options import DEFAULT_OPTIONS, Options
from seqckpt.checkpoint import run_region
from seqckpt.planner.tree import Plan, PlanError, Run, plan_from_sizes, uniform_plan
from seqckpt.policies import Policy

__all__ = ["resolve_plan", "run_plan"]


def resolve_plan(
    segments: object,
    chain: Sequence[Callable[[Any], Any]],
    policy: Policy | None = None,
) -> Plan:
    """Turn any accepted form of ``segments`` into a plan for ``chain``; the
    checkpointed segments of a count or of sizes keep what ``policy`` selects.

    An int ``k`` gives balanced segments whose checkpointed stretches never
    start at an item that writes into its input (``inplace=True``, as
    ``nn.ReLU(inplace=True)``): such a boundary moves to the next item, since a
    recompute would start from the overwritten values. Sizes and plans are
    taken as given; a plan carries its own policies.
    """
    n = len(chain)
    if isinstance(segments, Plan):
        if policy is not None:
            raise ValueError(
                f"seqckpt: policy={policy} was given with segments=plan; a plan "
                "carries a policy per recomputed stretch: build it with them, or "
                "give segments as a count or sizes."
            )
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
        return uniform_plan(n, segments, lambda i: _writes_its_input(chain[i]), policy)
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
        return plan_from_sizes(list(segments), policy)
    raise TypeError(
        "seqckpt: segments must be an int, a list of segment sizes, a Plan or "
        f"'auto', got {segments!r} ({type(segments).__name__})."
    )


def each_item_plan(
    chain: Sequence[Callable[[Any], Any]],
    policy: Policy | None = None,
    joins: Callable[[object], bool] | None = None,
) -> Plan:
    """Every item of ``chain`` checkpointed on its own, the last too (timm's
    ``checkpoint_seq`` and HF's per-layer checkpointing), each keeping what
    ``policy`` selects; an item that writes into its input joins the one
    before it, as in :func:`resolve_plan`, and so does one for which
    ``joins`` is true.

    Example:
        >>> import torch
        >>> print(each_item_plan([torch.nn.Tanh(), torch.nn.ReLU(inplace=True)]))
        Plan for layers 0-1
          recompute 0-1
            keep 0-1
    """
    n = len(chain)

    def blocked(i: int) -> bool:
        return _writes_its_input(chain[i]) or (joins is not None and joins(chain[i]))

    return uniform_plan(n, n, blocked, policy, False)


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
    as one checkpointed region that keeps what the item's policy selects, so
    nested plans nest checkpoints.
    """
    x = input
    for item in plan.items:
        if isinstance(item, Run):
            for i in range(item.start, item.stop):
                x = modules[i](x)
        else:
            inner_options = options
            if item.policy is not options.policy:
                inner_options = dataclasses.replace(options, policy=item.policy)
            region = functools.partial(run_plan, item.inner, modules, options=options)
            # (compiled code hands regions to torch, which needs no walk)
            generators: list[torch.Generator] = []
            runs = (
                None
                if torch.compiler.is_compiling()
                else modules_of(tuple(modules[item.start : item.stop]), generators)
            )
            name = f"layers {item.start}-{item.stop - 1}"  # what errors call it
            x = run_region(region, (x,), {}, inner_options, runs, name, generators)
    return x
