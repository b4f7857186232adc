"""Checkpointing a chain: the plan executor, :func:`checkpoint_sequential` and the
drop-in :class:`CheckpointedSequential`.

``segments`` in every form (a count, a list of sizes, a :class:`~seqckpt.planner.Plan`)
becomes a plan in :func:`resolve_plan`, and :func:`run_plan` runs any plan with the
one primitive. No strategy is special-cased in the executor.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from seqckpt.checkpoint import DeterminismCheck, _check_arguments, run_region
from seqckpt.planner.budget import parse_budget
from seqckpt.planner.planning import auto_plan
from seqckpt.planner.tree import (
    Plan,
    PlanError,
    Run,
    default_segments,
    plan_from_sizes,
    uniform_plan,
)

__all__ = ["CheckpointedSequential", "checkpoint_sequential", "run_plan"]

Segments = int | Sequence[int] | Plan | str
Chain = nn.Sequential | nn.ModuleList | Sequence[Callable[[Any], Any]]


def as_chain(modules: object) -> list[Callable[[Any], Any]]:
    """The items of ``modules`` as a list, checked: non-empty, all callable."""
    if isinstance(modules, (nn.Sequential, nn.ModuleList, list, tuple)):
        items = list(modules)
    else:
        raise TypeError(
            "seqckpt: argument 'modules' must be an nn.Sequential, nn.ModuleList, "
            f"list or tuple of modules or callables, got {type(modules).__name__}."
        )
    if not items:
        raise ValueError(
            "seqckpt: argument 'modules' is an empty chain; give at least one module."
        )
    for i, item in enumerate(items):
        if not callable(item):
            raise TypeError(
                f"seqckpt: modules[{i}] is not callable: {item!r} "
                f"({type(item).__name__}); every item of the chain must be a module "
                "or a function."
            )
    return items


def resolve_plan(segments: object, n: int) -> Plan:
    """Turn any accepted form of ``segments`` into a plan for ``n`` modules."""
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
        return uniform_plan(n, segments)
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


def plan_for(
    segments: object,
    chain: Sequence[Callable[[Any], Any]],
    input: Any,
    memory_budget: int | str | None,
) -> Plan:
    """The plan for ``segments`` in any accepted form; ``"auto"`` asks the planner
    (see :func:`seqckpt.planner.planning.auto_plan`)."""
    if segments == "auto":
        return auto_plan(chain, input, memory_budget)
    _check_budget_use(segments, memory_budget)
    return resolve_plan(segments, len(chain))


def _check_budget_use(segments: object, memory_budget: object) -> None:
    if memory_budget is not None and segments != "auto":
        raise ValueError(
            f"seqckpt: memory_budget={memory_budget!r} is only used with "
            f"segments='auto', got segments={segments!r}; pass segments='auto' or "
            "plan with seqckpt.plan(..., memory_budget=...)."
        )


def run_plan(
    plan: Plan,
    modules: Sequence[Callable[[Any], Any]],
    input: Any,
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = "default",
) -> Any:
    """Run ``modules`` on ``input`` following ``plan``: the one executor.

    A :class:`~seqckpt.planner.Run` item calls its modules in turn; a
    :class:`~seqckpt.planner.Recompute` item calls this function on its inner plan
    inside :func:`seqckpt.checkpoint`, so nested plans nest checkpoints.
    """
    x = input
    for item in plan.items:
        if isinstance(item, Run):
            for i in range(item.start, item.stop):
                x = modules[i](x)
        else:
            region = functools.partial(
                run_plan,
                item.inner,
                modules,
                preserve_rng_state=preserve_rng_state,
                determinism_check=determinism_check,
            )
            x = run_region(
                region,
                (x,),
                modules=[
                    m
                    for m in modules[item.start : item.stop]
                    if isinstance(m, nn.Module)
                ],
                preserve_rng_state=preserve_rng_state,
                determinism_check=determinism_check,
            )
    return x


def checkpoint_sequential(
    modules: Chain,
    segments: Segments,
    input: Any,
    *,
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = "default",
    memory_budget: int | str | None = None,
) -> Any:
    """Run a chain of modules with all but its last segment checkpointed.

    Args:
        modules: an ``nn.Sequential``, ``nn.ModuleList``, or a list or tuple of
            modules or plain callables. A nested ``nn.Sequential`` is one item.
        segments: an int ``k`` (1 <= k <= number of modules): ``k`` contiguous
            segments whose sizes differ by at most one, smaller ones first (torch
            puts the whole remainder in its last, plain segment); a list of
            segment sizes summing to the number of modules; or a
            :class:`~seqckpt.planner.Plan`, e.g. from :func:`seqckpt.plan`; or
            ``"auto"``: the fastest plan that fits ``memory_budget`` (or, for
            an input on CUDA, 90% of the device's free memory), planned on the
            first call for this chain and input shape and then reused.
        input: passed to the first module, as ``nn.Sequential`` does; tuples and
            dicts flowing between stages are fine.
        preserve_rng_state: see :func:`seqckpt.checkpoint`.
        determinism_check: see :func:`seqckpt.checkpoint`.
        memory_budget: with ``segments="auto"``: bytes, or a string such as
            ``"512MiB"`` (see :func:`seqckpt.plan`).

    Returns:
        The output of the last module. Outputs, gradients and buffers are bitwise
        those of the plain run on CPU.

    Raises:
        TypeError: ``modules`` or ``segments`` of a wrong type, a non-callable item.
        ValueError: an empty chain, ``segments`` out of range or sizes that do not
            sum to the number of modules.

    Example:
        >>> import torch, seqckpt
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> y = seqckpt.checkpoint_sequential(model, 3, x)   # sizes 2, 2, 2
        >>> y = seqckpt.checkpoint_sequential(model, [3, 2, 1], x)
        >>> y.sum().backward()
    """
    chain = as_chain(modules)
    _check_arguments(run_plan, preserve_rng_state, determinism_check)
    if not torch.is_grad_enabled():
        if segments != "auto":
            resolve_plan(segments, len(chain))
        for module in chain:
            input = module(input)
        return input
    plan = plan_for(segments, chain, input, memory_budget)
    return run_plan(plan, chain, input, preserve_rng_state, determinism_check)


class CheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose forward is checkpointed while training.

    Constructed like ``nn.Sequential`` (modules, or one ``OrderedDict``) plus the
    keyword ``segments`` (any form :func:`checkpoint_sequential` accepts; the
    default, None, means about sqrt(number of modules) balanced segments). Its
    ``state_dict`` keys are those of the ``nn.Sequential`` it replaces, and
    indexing, slicing, ``len`` and ``append`` behave the same. In ``eval()`` mode
    or without grad its forward is exactly ``nn.Sequential.forward``.

    Example:
        >>> import torch
        >>> from seqckpt import CheckpointedSequential
        >>> model = CheckpointedSequential(
        ...     *[torch.nn.Linear(8, 8) for _ in range(4)], segments=2)
        >>> model(torch.randn(3, 8)).sum().backward()
        >>> plain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> plain.load_state_dict(model.state_dict())
        <All keys matched successfully>
    """

    def __init__(
        self,
        *args: Any,
        segments: Segments | None = None,
        preserve_rng_state: bool = True,
        determinism_check: DeterminismCheck = "default",
        memory_budget: int | str | None = None,
    ) -> None:
        super().__init__(*args)
        _check_arguments(run_plan, preserve_rng_state, determinism_check)
        if memory_budget is not None:
            parse_budget(memory_budget)
        _check_budget_use(segments, memory_budget)
        if segments is not None and segments != "auto" and len(self) > 0:
            resolve_plan(segments, len(self))  # fail early on a bad value
        self.segments = segments
        self.memory_budget = memory_budget
        self.preserve_rng_state = preserve_rng_state
        self.determinism_check: DeterminismCheck = determinism_check

    @classmethod
    def from_sequential(
        cls,
        sequential: nn.Sequential,
        segments: Segments | None = None,
        **options: Any,
    ) -> CheckpointedSequential:
        """Wrap the modules of ``sequential`` (the same objects, not copies).

        Example:
            >>> import torch
            >>> from seqckpt import CheckpointedSequential
            >>> seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            >>> ckpt = CheckpointedSequential.from_sequential(seq, segments=1)
            >>> ckpt[0] is seq[0]
            True
        """
        if not isinstance(sequential, nn.Sequential):
            raise TypeError(
                "seqckpt: from_sequential() needs an nn.Sequential, got "
                f"{type(sequential).__name__}."
            )
        module = cls(OrderedDict(sequential._modules), segments=segments, **options)
        module.train(sequential.training)
        return module

    def forward(self, input: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()) or len(self) == 0:
            return super().forward(input)  # type: ignore[no-untyped-call]
        chain = list(self)
        segments = self.segments
        if segments is None:
            segments = default_segments(len(chain))
        plan = plan_for(segments, chain, input, self.memory_budget)
        return run_plan(
            plan, chain, input, self.preserve_rng_state, self.determinism_check
        )

    def extra_repr(self) -> str:
        parts = [] if self.segments is None else [f"segments={self.segments!r}"]
        if self.memory_budget is not None:
            parts.append(f"memory_budget={self.memory_budget!r}")
        return ", ".join(parts)
