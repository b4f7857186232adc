"""The planner's public entry points: :func:`plan` for a chain and a budget, and
the ``segments="auto"`` choice of :func:`seqckpt.checkpoint_sequential`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from seqckpt._chain import as_chain
from seqckpt._tree import tensors_in
from seqckpt.planner.budget import parse_budget
from seqckpt.planner.profile import ChainProfile
from seqckpt.planner.profile import profile as profile_chain
from seqckpt.planner.solver import DEFAULT_SLOTS, fastest_plan
from seqckpt.planner.tree import Plan, PlanError

__all__ = ["auto_plan", "plan"]


def plan(
    modules: Any,
    sample_input: Any,
    memory_budget: int | str | None = None,
    *,
    profile: ChainProfile | None = None,
    slots: int = DEFAULT_SLOTS,
) -> Plan:
    """The fastest checkpointing plan for a chain whose peak fits a memory budget.

    The chain is profiled on ``sample_input`` (or ``profile`` is used), then the
    dynamic program picks, layer by layer, what to keep and what to recompute,
    nesting recomputation where that is faster.

    Args:
        modules: the chain, in any form :func:`seqckpt.checkpoint_sequential` takes.
        sample_input: a batch like the training batches (ignored when ``profile``
            is given).
        memory_budget: bytes, as an int or a string like ``"512MiB"`` or ``"2GB"``.
            It bounds the memory the training step holds at its peak *beyond* the
            parameters, their gradients and the input batch: activations kept for
            backward, activation gradients and temporaries. None: the fastest
            plan, which keeps everything.
        profile: a :class:`~seqckpt.planner.ChainProfile` from
            :func:`seqckpt.profile`, to plan several budgets from one profile.
        slots: how finely the solver divides the budget; more is slower and
            closer to the budget.

    Returns:
        A :class:`~seqckpt.Plan` with ``predicted_peak_bytes`` and
        ``predicted_time`` (seconds of forward and backward, from the profile).
        Pass it as ``segments=`` to :func:`seqckpt.checkpoint_sequential` or
        :class:`seqckpt.CheckpointedSequential`; ``plan.to_json()`` saves it.

    Raises:
        seqckpt.PlanError: no plan fits the budget; the message gives the smallest
            budget that fits.

    Example:
        >>> import torch, seqckpt
        >>> chain = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        >>> x = torch.randn(512, 256)
        >>> p = seqckpt.plan(chain, x, memory_budget="3MiB")
        >>> p.predicted_peak_bytes <= 3 * 2**20
        True
        >>> y = seqckpt.checkpoint_sequential(chain, p, x)
    """
    budget = None if memory_budget is None else parse_budget(memory_budget)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 8:
        raise ValueError(f"seqckpt: slots must be an int >= 8, got {slots!r}.")
    chain = as_chain(modules)
    if profile is None:
        profile = profile_chain(chain, sample_input)
    elif not isinstance(profile, ChainProfile):
        raise TypeError(
            "seqckpt: profile must be a ChainProfile from seqckpt.profile(), got "
            f"{type(profile).__name__}."
        )
    if len(profile) != len(chain):
        raise PlanError(
            f"seqckpt: profile has {len(profile)} layers but the chain has "
            f"{len(chain)} modules; profile this chain."
        )
    return fastest_plan(profile, budget, slots)


_AUTO_CACHE: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
_AUTO_CACHE_SIZE = 64
# Leave this share of the free CUDA memory unplanned (fragmentation, the loss).
CUDA_FREE_SHARE = 0.9


def _signature(input: Any) -> tuple[Any, ...]:
    return tuple(
        (tuple(t.shape), t.dtype, str(t.device), t.requires_grad)
        for t in tensors_in(input)
    )


def _free_bytes(input: Any) -> int:
    for t in tensors_in(input):
        if t.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(t.device)
            cached = torch.cuda.memory_reserved(t.device) - torch.cuda.memory_allocated(
                t.device
            )
            return int(CUDA_FREE_SHARE * (free + cached))
    raise ValueError(
        "seqckpt: segments='auto' without memory_budget plans for the free memory "
        "of the input's CUDA device, but the input is not on CUDA; give "
        "memory_budget= (e.g. memory_budget='2GiB')."
    )


def auto_plan(
    chain: Sequence[Any], input: Any, memory_budget: int | str | None
) -> Plan:
    """The plan for ``segments="auto"``: planned on the first call for this chain,
    input shape and budget, then reused (at most 64 plans are remembered)."""
    key = (tuple(id(m) for m in chain), _signature(input), memory_budget)
    cached = _AUTO_CACHE.get(key)
    if cached is not None:
        _AUTO_CACHE.move_to_end(key)
        return cached
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "seqckpt: segments='auto' cannot profile the chain inside torch.compile; "
            "run one eager training step first, or pass seqckpt.plan(...) as "
            "segments."
        )
    budget = _free_bytes(input) if memory_budget is None else memory_budget
    result = plan(chain, input, budget)
    _AUTO_CACHE[key] = result
    if len(_AUTO_CACHE) > _AUTO_CACHE_SIZE:
        _AUTO_CACHE.popitem(last=False)
    return result
