"""The planner's public entry points: :func:`plan` for a chain and a budget, and
the ``segments="auto"`` choice of :func:`seqckpt.checkpoint_sequential`."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, TypeVar

import torch
from torch import nn

from seqckpt._buffers import bound_by, modules_of
from seqckpt._chain import as_chain
from seqckpt._state import is_exporting
from seqckpt._tree import tensors_in
from seqckpt.memory import MemoryStats, track_memory
from seqckpt.planner.adaptive import (
    BudgetSource,
    Frontier,
    Shape,
    budget_now,
    image_sizes,
    input_batch,
    input_size,
)
from seqckpt.planner.budget import format_bytes, parse_budget
from seqckpt.planner.profile import (
    ChainProfile,
    _candidates,
    chain_modules,
    chain_parameters,
    parameters_of,
)
from seqckpt.planner.profile import profile as profile_chain
from seqckpt.planner.solver import DEFAULT_SLOTS, fastest_plan
from seqckpt.planner.tree import Plan, PlanError, uniform_plan

__all__ = [
    "AUTO_STATS",
    "DEFAULT_POLICIES",
    "auto_frontier",
    "auto_step",
    "available_bytes",
    "plan",
    "with_policies",
]

# The candidate policies of each recomputed stretch when none are given.
DEFAULT_POLICIES: tuple[Any, ...] = (None, "compute_heavy")


def plan(
    modules: Any,
    sample_input: Any,
    memory_budget: int | str | None = None,
    *,
    profile: ChainProfile | None = None,
    slots: int = DEFAULT_SLOTS,
    policies: Sequence[Any] | None = None,
    frontier: bool = False,
) -> Any:
    """The fastest checkpointing plan for a chain whose peak fits a memory budget.

    The chain is profiled on ``sample_input`` (or ``profile`` is used), then the
    dynamic program picks, layer by layer, what to keep and what to recompute,
    nesting recomputation where that is faster, and for each recomputed stretch
    which of ``policies`` it recomputes under (what it keeps in forward, see
    :mod:`seqckpt.policies`): boundaries, nesting and policies together, exact
    with respect to the cost model (:mod:`seqckpt.planner.cost`). Chains longer
    than 100 layers are planned on 100 groups of adjacent cheap layers (see
    :mod:`seqckpt.planner.coarse`).

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
        policies: the candidate policies of each recomputed stretch (``None``
            in it: recomputing everything). Default: ``(None, "compute_heavy")``,
            or with ``profile`` the policies it measured; a policy given here
            must have been measured by ``profile``.
        frontier: return a :class:`~seqckpt.planner.adaptive.Frontier` instead:
            the plans of every budget, for inputs of every size (its
            ``plan_for(batch, budget)`` picks one per batch; ``to_json`` saves
            it); ``memory_budget`` is then not used.

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
        policies = DEFAULT_POLICIES if policies is None else policies
        profile = profile_chain(chain, sample_input, policies=policies)
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
    if policies is not None:
        profile = with_policies(profile, policies)
    if frontier:
        return Frontier(
            [(input_size(sample_input), profile)],
            slots=slots,
            images=image_sizes(sample_input),
            batches=[input_batch(sample_input)],
        )
    return fastest_plan(profile, budget, slots)


def with_policies(profile: ChainProfile, policies: Sequence[Any]) -> ChainProfile:
    """``profile`` keeping only the measurements of ``policies`` (None is always
    a candidate); raises PlanError for a policy the profile did not measure."""
    wanted = _candidates(policies)
    measured = profile.policies
    missing = [p for p in wanted if p not in measured]
    if missing:
        raise PlanError(
            f"seqckpt: the profile has no measurements for policy "
            f"{', '.join(map(str, missing))}; profile with "
            f"seqckpt.profile(..., policies={[None, *map(str, wanted)]})."
        )
    if list(measured) == wanted:
        return profile
    keep = [measured.index(p) for p in wanted]
    layers = tuple(
        dataclasses.replace(layer, policies=tuple(layer.policies[i] for i in keep))
        for layer in profile.layers
    )
    return dataclasses.replace(profile, layers=layers)


# What segments="auto" keeps for each chain and kind of input (see
# _frontier_key): what identifies the chain's items (see _holders), the
# chain's parameters (read once: walking its modules at every step would cost
# more than choosing the plan) and a frontier for each set of them that
# requires grad; the least recently used of 64 goes first.
_FRONTIERS: dict[tuple[Any, ...], _ChainEntry] = {}
# The plan chosen for the last (frontier, input size, input batch, budget)
# keys (the frontier by its serial number: dynamo cannot trace id()).
_AUTO_CACHE: OrderedDict[tuple[int, int, int | None, int], tuple[Frontier, Plan]] = (
    OrderedDict()
)
_AUTO_CACHE_SIZE = 64
# Timed runs per item in the profiles segments="auto" takes on the training
# stream: one (the lines fitted through two or three profiled sizes smooth a
# single run's noise, and every extra run costs about a training step).
AUTO_REPEATS = 1
# Leave this share of the free CUDA memory unplanned (fragmentation, the loss).
CUDA_FREE_SHARE = 0.9
# Optimizer state per parameter byte kept free when planning for free memory
# before the first step has allocated it (Adam's two moments).
OPTIMIZER_STATE_PER_PARAMETER = 2


def _cuda_device(input: Any) -> torch.device:
    for t in tensors_in(input):
        if t.device.type == "cuda":
            return t.device
    raise ValueError(
        "seqckpt: segments='auto' without memory_budget plans for the free memory "
        "of the input's CUDA device, but the input is not on CUDA; give "
        "memory_budget= (e.g. memory_budget='2GiB')."
    )


def available_bytes(chain: Sequence[Any], free: int, cached: int) -> int:
    """The budget ``segments="auto"`` plans for on CUDA: 90% of the free and
    cached memory, less what the step has yet to allocate: the gradients of
    trainable parameters that have none yet and, while no gradient exists at
    all (before the first step), an Adam-like optimizer state of two buffers
    per parameter. Raises ``PlanError`` when nothing is left.

    Example:
        >>> from torch import nn
        >>> layer = nn.Linear(1000, 1000)  # 4 MB of weight and bias
        >>> available_bytes([layer], free=100_000_000, cached=0) < 90_000_000 - 12_000_000
        True
    """
    params = [p for p in chain_parameters(chain) if p.requires_grad]
    missing_grads = sum(p.nbytes for p in params if p.grad is None)
    first_step = all(p.grad is None for p in params)
    optimizer = OPTIMIZER_STATE_PER_PARAMETER * sum(p.nbytes for p in params)
    room = int(CUDA_FREE_SHARE * (free + cached)) - missing_grads
    if first_step:
        room -= optimizer
    if room <= 0:
        raise PlanError(
            f"seqckpt: segments='auto' found {format_bytes(free + cached)} free on "
            "the device, not enough for this chain's gradients and optimizer "
            f"state ({format_bytes(missing_grads + first_step * optimizer)}); "
            "free memory, or give memory_budget= explicitly."
        )
    return room


def _device_budget(chain: Sequence[Any], input: Any) -> int:
    device = _cuda_device(input)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return available_bytes(chain, free, cached)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _smallest_on_any_rank(budget: int, input: Any) -> int:
    """Under torch.distributed, the smallest budget of all ranks."""
    import torch.distributed as dist

    value = torch.tensor([budget], dtype=torch.int64, device=_collective_device(input))
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank (as bytes in a tensor: torch's object
    collectives need NumPy, which seqckpt does not depend on)."""
    import torch.distributed as dist

    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()


def _collective_device(input: Any) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return next(t.device for t in tensors_in(input) if t.device.type == "cuda")
    return torch.device("cpu")


def _rank_zero_plan(result: Plan | PlanError, input: Any) -> Plan:
    """Under torch.distributed, every rank takes rank 0's plan (profiles differ
    by timing noise, so each rank's own solve could pick another one)."""
    own = result.to_json() if isinstance(result, Plan) else str(result)
    text = broadcast_text(own, _collective_device(input))
    if not text.startswith("{"):
        raise PlanError(text)
    return Plan.from_json(text)


@dataclasses.dataclass
class AutoStats:
    """What ``segments="auto"`` has spent (for benchmarks and curiosity)."""

    profiles: int = 0
    profile_seconds: float = 0.0
    plan_seconds: float = 0.0
    steps: int = 0
    checks: int = 0  # steps measured against the prediction
    drifts: int = 0  # of those, beyond the frontier's tolerance


AUTO_STATS = AutoStats()


def _frontier_key(chain: Sequence[Any], input: Any) -> tuple[Any, ...]:
    """A chain and the kind of input it gets: each tensor's rank, dtype,
    device and grad flag, the input's :func:`image_sizes`, so that each image
    size (or signal length) gets a frontier of its own, profiled at it, while
    batch sizes and sequence lengths share one, and autocast's state (a step
    under bf16 autocast keeps other bytes than one in float32)."""
    tensors = tensors_in(input)
    kinds = tuple((t.dim(), t.dtype, str(t.device), t.requires_grad) for t in tensors)
    device_type = tensors[0].device.type if tensors else "cpu"
    # (a device type without autocast, such as meta, raises in the second
    # call; the dynamo of torch 2.8 cannot trace the first, and traces only
    # real devices' tensors)
    available = torch.compiler.is_compiling() or torch.amp.is_autocast_available(
        device_type
    )
    autocast = (
        torch.get_autocast_dtype(device_type)
        if available and torch.is_autocast_enabled(device_type)
        else None
    )
    return (tuple(id(m) for m in chain), kinds, image_sizes(tensors), autocast)


# what a chain's frontier depends on besides its input (see _ChainEntry.state)
_State = tuple[tuple[bool, ...], tuple[bool, ...], tuple[torch.dtype | None, ...]]


class _ChainEntry:
    """A chain's frontiers (see :data:`_FRONTIERS`): a chain whose layers
    are frozen or unfrozen between steps (gradual unfreezing in fine-tuning,
    a GAN's discriminator frozen for the generator's step) keeps other
    tensors for backward, and so does one whose modules switch between
    training and eval mode (dropout keeps its mask only in training; an
    attack computed in eval mode before the training step), and so does one
    whose parameters were cast to another dtype, so each set of parameters
    that require grad, of modules in training mode and of parameter dtypes
    gets a frontier of its own. (A plain class: dynamo 2.13 fails to trace a
    dataclass's attributes here.)"""

    __slots__ = ("holders", "parameters", "modules", "frontiers")

    def __init__(self, chain: Sequence[Any], like: _ChainEntry | None = None) -> None:
        self.holders = _holders(chain)
        self.parameters: list[weakref.ref[torch.Tensor]]
        self.modules: list[weakref.ref[nn.Module]]
        self.frontiers: dict[_State, Frontier]
        if like is not None:  # the same chain remade (see _entry_for)
            self.parameters, self.modules = like.parameters, like.modules
            self.frontiers = like.frontiers
        else:
            # (weakly, as the items: a freed chain's parameters stay freed)
            modules = chain_modules(chain)
            self.parameters = [weakref.ref(p) for p in parameters_of(modules)]
            self.modules = [weakref.ref(m) for m in modules]
            self.frontiers = {}

    def state(self) -> _State:
        """Which parameters require grad, which modules are training, and the
        parameters' dtypes (a model cast with ``.float()`` after steps in
        bfloat16 keeps twice the bytes)."""
        parameters = [p() for p in self.parameters]
        return (
            tuple([getattr(p, "requires_grad", False) for p in parameters]),
            tuple([getattr(m(), "training", False) for m in self.modules]),
            tuple([getattr(p, "dtype", None) for p in parameters]),
        )


# Chains whose callables are made anew at every call (a functools.partial or a
# lambda per block, to pass the batch's mask), by what their items run: a
# remade chain shares the frontiers of the one before instead of profiling
# again at every step.
_BY_RUNS: OrderedDict[tuple[Any, ...], tuple[Any, _ChainEntry]] = OrderedDict()


def _runs(item: Any) -> tuple[Any, ...] | None:
    """What tells a chain item apart for planning: a module itself; another
    callable, its code (or the module a ``functools.partial`` calls) and the
    modules it runs; None where the module walk finds none (reached through
    a global object's attribute): then only the object itself tells it
    apart."""
    if isinstance(item, nn.Module):
        return (item,)
    func = item
    while isinstance(func, functools.partial):
        func = func.func
    code = (
        func
        if isinstance(func, nn.Module)
        else getattr(getattr(func, "__func__", func), "__code__", None)
    )
    modules = modules_of(item)
    return (code, *modules) if code is not None and modules else None


def _settings(chain: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
    """What tells the items of ``chain`` apart besides their code and the
    modules they reach: the plain values (numbers, strings, slices, tuples
    of them) each binds in its partials' arguments, default arguments and
    closure, at the places where the items differ. ``lambda t, i=i:
    blocks[i](t)`` for ``i`` in 0..3 and for ``i`` in 4..7 are other chains;
    a value every item binds alike (``functools.partial(block,
    seq_len=n)`` with the batch's length) is left out, so a new length does
    not make a new chain (lengths share one frontier)."""
    bound = [_bound_values(item) for item in chain]
    width = max(map(len, bound), default=0)
    varying = [
        j
        for j in range(width)
        if len({b[j] if j < len(b) else None for b in bound}) > 1
    ]
    return tuple(tuple(b[j] for j in varying if j < len(b)) for b in bound)


def _bound_values(item: Any) -> tuple[Any, ...]:
    values: list[Any] = []
    func = item
    while isinstance(func, functools.partial):
        values += [*func.args, *func.keywords.values()]
        func = func.func
    values += bound_by(func)
    return tuple(_hashable(v) for v in values if _plain(v))


def _plain(value: Any) -> bool:
    if type(value) is tuple:
        return all(map(_plain, value))
    return type(value) in (int, bool, float, str, slice)


def _hashable(value: Any) -> Any:
    """``value`` with its slices as tuples (unhashable before Python 3.12)."""
    if type(value) is slice:
        return ("slice", value.start, value.stop, value.step)
    if type(value) is tuple:
        return tuple(map(_hashable, value))
    return value


def _entry_for(chain: Sequence[Any], key: tuple[Any, ...]) -> _ChainEntry:
    """A new entry for ``chain``, sharing the frontiers of an earlier chain
    whose items run the same code on the same modules with the same plain
    settings (see :data:`_BY_RUNS`)."""
    if torch.compiler.is_compiling() or all(
        isinstance(item, nn.Module) for item in chain
    ):
        return _ChainEntry(chain)
    runs = [r for r in map(_runs, chain) if r is not None]
    if len(runs) < len(chain):  # an item told apart by the object alone
        return _ChainEntry(chain)
    runs_key = (
        tuple(tuple(map(id, r)) for r in runs),
        _settings(chain),
        *key[1:],
    )
    found = _BY_RUNS.get(runs_key)
    if found is not None and all(
        _same_items(held, r) for held, r in zip(found[0], runs, strict=True)
    ):
        _BY_RUNS.move_to_end(runs_key)
        return _ChainEntry(chain, like=found[1])
    entry = _ChainEntry(chain)
    _BY_RUNS.pop(runs_key, None)
    _BY_RUNS[runs_key] = (tuple(_holders(r) for r in runs), entry)
    if len(_BY_RUNS) > _AUTO_CACHE_SIZE:
        _BY_RUNS.popitem(last=False)
    return entry


def _holders(chain: Sequence[Any]) -> tuple[tuple[bool, Any], ...]:
    """``(True, weak reference)`` for each item of ``chain`` (``(False,
    item)`` where it takes none, e.g. a builtin, which lives as long as the
    process): a cached frontier is keyed by the items' ids, and a chain built
    after another was freed may reuse its ids (a sweep over model widths does).
    A flag rather than ``isinstance(h, weakref.ref)``: dynamo 2.8 cannot trace
    that check, and the lookup runs inside compiled code."""
    held: list[tuple[bool, Any]] = []
    for item in chain:
        try:
            held.append((True, weakref.ref(item)))
        except TypeError:
            held.append((False, item))
    return tuple(held)


def _same_items(held: tuple[tuple[bool, Any], ...], chain: Sequence[Any]) -> bool:
    return len(held) == len(chain) and all(
        (h() if weak else h) is item
        for (weak, h), item in zip(held, chain, strict=False)
    )


def _timed_profile(
    chain: Sequence[Any], input: Any, policies: Sequence[Any]
) -> ChainProfile:
    began = time.perf_counter()
    try:
        return profile_chain(chain, input, repeats=AUTO_REPEATS, policies=policies)
    finally:
        AUTO_STATS.profiles += 1
        AUTO_STATS.profile_seconds += time.perf_counter() - began


def auto_frontier(
    chain: Sequence[Any], input: Any, size: int, batch: int | None
) -> Frontier:
    """The frontier ``segments="auto"`` keeps for this chain, kind of input
    (``size`` and ``batch`` are the input's :func:`input_size` and
    :func:`input_batch`; an image size or signal
    length is a kind of its own, see :func:`image_sizes`) and set of
    trainable parameters (see :class:`_ChainEntry`): profiled on the first
    call, and again where :meth:`Frontier.needs_profile` asks (the first size
    that differs by a tenth, the first batch of another length at one size,
    sizes or lengths beyond the profiled ones, measured peaks that
    drifted); then reused for every batch of that kind."""
    key = _frontier_key(chain, input)
    entry = _FRONTIERS.get(key)
    if entry is None or not _same_items(entry.holders, chain):
        entry = _entry_for(chain, key)
        _FRONTIERS.pop(key, None)  # a freed chain's, under reused ids
        _FRONTIERS[key] = entry
        if len(_FRONTIERS) > _AUTO_CACHE_SIZE:
            _FRONTIERS.pop(next(iter(_FRONTIERS)))
    elif not torch.compiler.is_compiling():
        # least recently used first out: a chain remade at every call adds an
        # entry per call, which must not push out the chains in use
        _FRONTIERS[key] = _FRONTIERS.pop(key)
    state = entry.state()
    frontier = entry.frontiers.get(state)
    if frontier is None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "seqckpt: segments='auto' cannot profile the chain inside "
                "torch.compile; run one eager training step first (and again "
                "after freezing or unfreezing layers, switching modules between "
                "train() and eval(), casting the model to another dtype, or "
                "turning autocast on or off), or pass "
                "seqckpt.plan(...) as segments."
            )
        frontier = Frontier(
            [(size, _timed_profile(chain, input, DEFAULT_POLICIES))],
            batches=[batch],
        )
        entry.frontiers[state] = frontier
    elif frontier.needs_profile(size, batch) and not torch.compiler.is_compiling():
        policies = [None, *frontier.points[0][1].policies]
        frontier.add_profile(size, _timed_profile(chain, input, policies), batch)
    return frontier


def _auto_choice(
    frontier: Frontier,
    chain: Sequence[Any],
    input: Any,
    size: int,
    batch: int | None,
    memory_budget: BudgetSource | None,
) -> Plan:
    """The fastest plan of ``frontier`` whose predicted peak for this input
    fits the budget (an int, a string, or a callable evaluated now; on CUDA
    without one, the free memory, see :func:`available_bytes`).

    Under ``torch.distributed`` every rank plans at the same call with the
    smallest budget of all ranks, and every rank uses rank 0's plan."""
    timed = not torch.compiler.is_compiling()  # dynamo cannot trace the clock
    began = time.perf_counter() if timed else 0.0
    try:
        budget = (
            _device_budget(chain, input)
            if memory_budget is None
            else budget_now(memory_budget)
        )
        if _distributed():  # every call: all ranks then share the cache's keys
            budget = _smallest_on_any_rank(budget, input)
        key = (frontier.serial, size, batch, budget)
        cached = _AUTO_CACHE.get(key)
        if cached is not None and cached[0] is frontier:
            return cached[1]
        if _distributed():
            try:
                result: Plan | PlanError = frontier.plan_for(size, budget, batch)
            except PlanError as error:
                result = error
            chosen = _rank_zero_plan(result, input)
        else:
            chosen = frontier.plan_for(size, budget, batch)
        _AUTO_CACHE[key] = (frontier, chosen)
        if len(_AUTO_CACHE) > _AUTO_CACHE_SIZE:
            _AUTO_CACHE.popitem(last=False)
        return chosen
    finally:
        if timed:
            AUTO_STATS.steps += 1
            AUTO_STATS.plan_seconds += time.perf_counter() - began


# Devices on which segments="auto" measures the first step of each size class
# and checks the frontier's prediction with it (Frontier.observe). On CUDA the
# allocator's counters make that nearly free; on the CPU the live-tensor
# tracker would slow that step down several times, so there the check is left
# to the tests and to users (Frontier.observe with seqckpt.track_memory).
AUTO_CHECK_DEVICES: tuple[str, ...] = ("cuda",)
T = TypeVar("T")


class _PeakCheck:
    """One step measured for the frontier: from the chain's forward to the end
    of the backward that follows (the whole backward; what the rest of the
    model holds meanwhile counts too, so a chain inside a model with large
    outside activations may see one extra profile per size class)."""

    current: _PeakCheck | None = None  # at most one open, the latest

    def __init__(
        self, frontier: Frontier, shape: Shape, plan: Plan, device: Any
    ) -> None:
        self.frontier, self.shape, self.plan = frontier, shape, plan
        self.observed = False
        self.stack = ExitStack()
        self.stats: MemoryStats = self.stack.enter_context(track_memory(device))

    def close(self) -> None:
        if _PeakCheck.current is self:
            _PeakCheck.current = None
        self.stack.close()

    def observe(self) -> None:
        """At the end of the backward: compare the peak with the prediction."""
        self.observed = True
        AUTO_STATS.checks += 1
        size, batch = self.shape
        if self.frontier.observe(size, self.stats.peak_so_far(), self.plan, batch):
            AUTO_STATS.drifts += 1
        if self.stats.device.type == "cuda":
            self.close()
        # The CPU tracker is a thread-local dispatch mode, which the autograd
        # engine restores after this callback: the next step closes it.

    def end_with_backward(self, out: Any) -> None:
        """Observe when the backward through ``out`` ends; a step without one
        is closed, unobserved, by the next step."""
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

        def started() -> None:
            if _PeakCheck.current is self and not self.observed:
                engine.queue_callback(self.observe)

        if not _when_backward_starts(out, started):
            self.close()


def _when_backward_starts(out: Any, call: Callable[[], None]) -> bool:
    """Call ``call`` when a backward through ``out`` starts (when the first
    of its tensors that require grad gets its gradient); False where none
    does."""
    roots = [t for t in tensors_in(out) if t.requires_grad]
    if roots:
        roots[0].register_hook(lambda grad: call())  # type: ignore[no-untyped-call]
    return bool(roots)


# Frontiers whose first step was checked for a backward inside the autocast
# block (see _warn_if_backward_under_autocast).
_CAST_CHECKED: weakref.WeakSet[Frontier] = weakref.WeakSet()


def _warn_if_backward_under_autocast(out: Any, device_type: str) -> None:
    """Warn when the backward through ``out`` starts inside a
    ``torch.autocast`` block with its cache on: the plans count the weight
    casts a recomputed stretch leaves in the cache as freed when the block
    ends, before backward (torch's recipe); inside it they stay until the
    block ends, and the step can run over the budget."""

    def started() -> None:
        if torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled():
            warnings.warn(
                "seqckpt: backward runs inside the torch.autocast block of the "
                "forward, with autocast's cache on: the weight casts a recomputed "
                "stretch leaves in that cache stay until the block ends, but "
                "segments='auto' plans them as freed when it ends before backward, "
                "as torch's mixed-precision recipe runs it, so steps can run over "
                "the budget. Call loss.backward() after the `with torch.autocast"
                "(...)` block.",
                stacklevel=2,
            )

    _when_backward_starts(out, started)


def auto_step(
    chain: Sequence[Any],
    input: Any,
    memory_budget: BudgetSource | None,
    run: Callable[[Plan], T],
) -> T:
    """One step of ``segments="auto"``: the chain's frontier (see
    :func:`auto_frontier`) gives the plan for this input and budget (see
    :func:`_auto_choice`) and ``run(plan)`` runs it. The first step of each
    size class on a device in :data:`AUTO_CHECK_DEVICES` is measured and its
    peak checked against the frontier's prediction (a drift beyond the
    frontier's tolerance makes the next batch of that size profile again).
    The chain runs plainly, with nothing planned or profiled, under
    ``torch.export`` (an exported program holds no checkpoint), for an
    empty batch (no activations to drop; a profile of one would scale to
    nothing) and on the meta device (shape and FLOP counting: no memory to
    measure); an input without tensors has no size to plan for: an error."""
    if is_exporting():
        return run(uniform_plan(len(chain), 1))  # one segment: all plain
    device = next((t.device for t in tensors_in(input)), None)
    if device is None:
        raise ValueError(
            "seqckpt: segments='auto' plans for the size of the chain's input, and "
            f"this input holds no tensor (a {type(input).__name__}); give segments "
            "as a count, sizes or a plan (seqckpt.plan(...)), or start the chain "
            "at the first module that takes a tensor."
        )
    size = input_size(input)
    if size == 0 or device.type == "meta":
        return run(uniform_plan(len(chain), 1))
    batch = input_batch(input)
    frontier = auto_frontier(chain, input, size, batch)
    plan = _auto_choice(frontier, chain, input, size, batch, memory_budget)
    if torch.compiler.is_compiling():
        return run(plan)
    if _PeakCheck.current is not None:  # observed on the CPU, or no backward
        _PeakCheck.current.close()
    casts = frontier not in _CAST_CHECKED
    if casts:  # the first step of a frontier: was it profiled under autocast?
        _CAST_CHECKED.add(frontier)
        casts = any(p.region_cast_bytes for _, c in frontier.points for p in c.layers)
    if device.type not in AUTO_CHECK_DEVICES or not frontier.first_of_class(
        size, batch
    ):
        out = run(plan)
    else:
        check = _PeakCheck(frontier, (size, batch), plan, device)
        _PeakCheck.current = check
        try:
            out = run(plan)
        except BaseException:
            check.close()
            raise
        check.end_with_backward(out)
    if casts:
        _warn_if_backward_under_autocast(out, device.type)
    return out
