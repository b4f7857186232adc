"""Capture and replay of the global state a recompute must see.

A checkpointed function runs twice: once in forward and once in backward. Between
the two, the caller may have moved on: drawn random numbers, left an autocast
region or an ``sdpa_kernel`` block, changed the default device or dtype, switched
TF32 or deterministic algorithms, toggled the TorchScript optimiser. This module
records what the first run saw and replays it around the second, then restores
whatever the caller had. It also owns the thread-local flags behind
:func:`seqckpt.is_checkpointing` and :func:`seqckpt.is_recomputing`.

Internal: nothing here is public API.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from typing import Any, TypeVar

import torch
import torch.nn.utils.parametrize as _parametrize
import torch.utils.checkpoint
from torch.utils._python_dispatch import _pop_mode, _push_mode

# --------------------------------------------------------------------------- flags

# Depth of first runs and of recomputes on this thread (context variables are
# per thread, and cheaper to read and set than a threading.local).
_CHECKPOINTING: contextvars.ContextVar[int] = contextvars.ContextVar(
    "seqckpt_checkpointing", default=0
)
_RECOMPUTING: contextvars.ContextVar[int] = contextvars.ContextVar(
    "seqckpt_recomputing", default=0
)
CHECKPOINTING, RECOMPUTING = _CHECKPOINTING, _RECOMPUTING

Phase = tuple[contextvars.Token[int], bool]


def begin(phase: contextvars.ContextVar[int]) -> Phase:
    """Enter a first run (:data:`CHECKPOINTING`) or a recompute
    (:data:`RECOMPUTING`): one level deeper in that flag, and TorchScript made to
    run unoptimised (see :func:`end`)."""
    token = phase.set(phase.get() + 1)
    previous: bool = torch._C._get_graph_executor_optimize()
    if previous:
        torch._C._set_graph_executor_optimize(False)
    return token, previous


def end(phase: contextvars.ContextVar[int], state: Phase) -> None:
    """Undo :func:`begin`.

    TorchScript runs unoptimised inside regions: the profiling executor runs a
    different graph on a module's first calls than on later ones (it saves 5
    tensors, then 7, for a two-layer MLP), which would make a recompute disagree
    with its forward. The unoptimised executor always runs the same graph.
    """
    token, previous = state
    if previous:
        torch._C._set_graph_executor_optimize(True)
    phase.reset(token)


def is_checkpointing() -> bool:
    """Tell whether the calling code runs inside the first forward of a checkpoint.

    Thread-local and nest-safe: ``True`` inside the first run of a checkpointed
    function (also the first run of an inner checkpoint while an outer one is
    being recomputed); ``False`` in a recompute of the function and elsewhere.

    Example:
        >>> import torch, seqckpt
        >>> def f(x):
        ...     assert seqckpt.is_checkpointing()
        ...     return x * 2
        >>> y = seqckpt.checkpoint(f, torch.ones(2, requires_grad=True))
        >>> seqckpt.is_checkpointing()
        False

    Under ``torch.compile`` it is ``False``: the compiled graph is traced once
    and recomputes without running Python.
    """
    if torch.compiler.is_compiling():
        return False  # (dynamo cannot trace the context variable)
    return _CHECKPOINTING.get() > 0


def is_recomputing() -> bool:
    """Tell whether the calling code runs inside a recompute during backward.

    Thread-local and nest-safe. Useful to skip side effects (logging, counters)
    that should happen once per step.

    Example:
        >>> import torch, seqckpt
        >>> seen = []
        >>> def f(x):
        ...     seen.append(seqckpt.is_recomputing())
        ...     return (x * 2).sin()  # sin saves x * 2: recomputed in backward
        >>> seqckpt.checkpoint(f, torch.ones(2, requires_grad=True)).sum().backward()
        >>> seen
        [False, True]

    Under ``torch.compile`` it is ``False`` (see :func:`is_checkpointing`).
    """
    if torch.compiler.is_compiling():
        return False
    return _RECOMPUTING.get() > 0


def is_exporting() -> bool:
    """Whether ``torch.export`` traces now (a region is then a plain call).
    Read from the flag ``torch.compiler.is_exporting()`` returns: dynamo in
    torch 2.8-2.10 takes that function for True under any ``torch.compile``."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


# ------------------------------------------------------------- bookkeeping ops

T = TypeVar("T")

# torch's selective-checkpointing modes (private classes; absent ones skipped)
_TORCH_SAC_MODES = tuple(
    mode
    for mode in (
        getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None),
        getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None),
    )
    if mode is not None
)


def _counts_ops(mode: Any) -> bool:
    """A mode that numbers ops to keep and serve their outputs: a seqckpt
    policy's (``counts_ops = True``) or torch's selective checkpointing."""
    return getattr(mode, "counts_ops", False) or isinstance(mode, _TORCH_SAC_MODES)


def unseen(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` unseen by the modes that number ops.

    seqckpt's own tensor work inside a region (buffer snapshots and their
    replay, the fingerprints of ``determinism_check="values"``) is bookkeeping:
    a policy's modes (seqckpt's or torch's selective checkpointing) must not
    keep it nor count it, or the forward and the recompute would number their
    ops differently and the recompute would be served another op's output.
    Every other mode (a memory tracker, a FLOP counter) still sees it: the
    modes from the lowest counting one up are taken off the stack and the
    others among them put back in their order, for the call.
    """
    depth = torch._C._len_torch_dispatch_stack()
    if depth == 0:
        return fn(*args)
    stack = [torch._C._get_dispatch_stack_at(i) for i in range(depth)]
    lowest = next((i for i, mode in enumerate(stack) if _counts_ops(mode)), None)
    if lowest is None:
        return fn(*args)
    lifted = stack[lowest:]
    for _ in lifted:
        _pop_mode()
    others = [mode for mode in lifted if not _counts_ops(mode)]
    for mode in others:
        _push_mode(mode)
    try:
        return fn(*args)
    finally:
        for _ in others:
            _pop_mode()
        for mode in lifted:
            _push_mode(mode)


# ----------------------------------------------------------------------------- RNG


def accelerator_devices(tensors: Iterable[torch.Tensor]) -> tuple[torch.device, ...]:
    """Non-CPU devices whose RNG a region may use: those of ``tensors`` plus the
    current CUDA device when CUDA is initialised (a region may draw on it even when
    its inputs live on the CPU)."""
    found: dict[torch.device, None] = {}
    for t in tensors:
        if not t.is_cpu and not t.is_meta:
            found[t.device] = None
    if cuda_initialized():
        found[torch.device("cuda", torch.cuda.current_device())] = None
    return tuple(found)


_CPU_GENERATOR = torch.default_generator


def cuda_generators() -> tuple[torch.Generator, ...]:
    """The default generator of every CUDA device once CUDA is initialised
    (a region may draw on any of them, whatever its inputs are on)."""
    return tuple(torch.cuda.default_generators) if cuda_initialized() else ()


def philox_state(generator: torch.Generator) -> tuple[int, int]:
    """A CUDA generator's state: (seed, offset), which is all of a Philox
    generator's state and cheap to read."""
    return generator.initial_seed(), generator.get_offset()


def put_philox_state(generator: torch.Generator, state: tuple[int, int]) -> None:
    """Give a CUDA generator a state :func:`philox_state` read (untouched
    where it has it already)."""
    if philox_state(generator) != state:
        generator.manual_seed(state[0])
        generator.set_offset(state[1])


class RngState:
    """The CPU generator's state; that of every CUDA device's generator (see
    :func:`philox_state`);
    the state of other accelerators the region's inputs are on; and the state
    of the region's own generators (``torch.Generator`` objects a module holds
    or the function is given, see :func:`generators_held`)."""

    __slots__ = ("cpu", "cuda", "devices", "own", "cpu_only")

    def __init__(
        self,
        cpu: torch.Tensor,
        cuda: tuple[tuple[torch.Generator, tuple[int, int]], ...],
        devices: tuple[tuple[torch.device, torch.Tensor], ...],
        own: tuple[tuple[torch.Generator, torch.Tensor], ...] = (),
    ) -> None:
        self.cpu = cpu
        self.cuda = cuda
        self.devices = devices
        self.own = own
        # the common case, replayed without loops
        self.cpu_only = not (cuda or devices or own)

    @staticmethod
    def capture(
        devices: tuple[torch.device, ...], own: Iterable[torch.Generator] = ()
    ) -> RngState:
        cpu = _CPU_GENERATOR.get_state()
        owned = tuple((g, g.get_state()) for g in own) if own else ()
        generators = cuda_generators()
        if not devices and not generators:  # the CPU alone: no loops
            return RngState(cpu, (), (), owned)
        others = tuple(d for d in devices if d.type != "cuda")
        return RngState(
            cpu,
            tuple((g, philox_state(g)) for g in generators),
            tuple(
                (d, torch.get_device_module(d.type).get_rng_state(d)) for d in others
            ),
            owned,
        )

    def restore(self) -> None:
        _CPU_GENERATOR.set_state(self.cpu)
        if self.cpu_only:
            return
        for generator, seed_offset in self.cuda:
            put_philox_state(generator, seed_offset)
        for d, state in self.devices:
            torch.get_device_module(d.type).set_rng_state(state, d)
        for g, state in self.own:
            g.set_state(state)

    def generator_keys(self) -> frozenset[int]:
        """The generators this state puts back (the CPU's, CUDA's and the
        region's own), by their C++ object: an op sees a generator it is given
        through a Python object of its own."""
        return frozenset(
            [
                generator_key(_CPU_GENERATOR),
                *(generator_key(g) for g, _ in self.cuda),
            ]
            + [generator_key(g) for g, _ in self.own]
        )

    def current(self) -> RngState:
        """The caller's state now, on the same devices and generators."""
        if self.cpu_only and not cuda_initialized():
            return RngState(_CPU_GENERATOR.get_state(), (), ())
        return RngState.capture(
            tuple([d for d, _ in self.devices]), [g for g, _ in self.own]
        )


_GENERATOR = torch.Generator


def generator_key(generator: torch.Generator) -> int:
    """What tells generators apart: their C++ object (an op is handed a
    generator it is given as a Python object of its own)."""
    key: int = generator._cdata  # type: ignore[attr-defined]
    return key


def generators_held(objects: Iterable[object], into: list[torch.Generator]) -> None:
    """Add to ``into`` each ``torch.Generator`` among ``objects`` that is not
    the CPU's default one (which :class:`RngState` replays anyway) and is not
    in ``into`` yet: a module that draws noise with ``generator=self.gen``
    advances its own generator, which a recompute must replay as it replays
    the default ones."""
    for g in objects:
        if type(g) is _GENERATOR and g is not _CPU_GENERATOR and g not in into:
            into.append(g)


# ----------------------------------------------------------------------- streams


def cuda_streams(
    devices: tuple[torch.device, ...],
) -> tuple[tuple[torch.device, torch.cuda.Stream], ...] | None:
    """The current stream of each CUDA device among ``devices``: where a
    region's first run queued its work."""
    found = tuple(
        (d, torch.cuda.current_stream(d)) for d in devices if d.type == "cuda"
    )
    return found or None


def wait_for_streams(
    streams: tuple[tuple[torch.device, torch.cuda.Stream], ...],
    inputs: Iterable[torch.Tensor],
) -> None:
    """Before a recompute on another stream than its first run (a backward run
    under ``torch.cuda.stream(...)``, a node on a side stream): make the
    recompute's stream wait for the first run's, and tell the allocator the
    region's inputs are used there too, so their memory is not reused early."""
    for device, first in streams:
        now = torch.cuda.current_stream(device)
        if now != first:
            now.wait_stream(first)
            for t in inputs:
                if t.device == device:
                    t.record_stream(now)


# ------------------------------------------------ autocast, device, backend switches


_CUDA = torch.cuda.is_available()


def cuda_initialized() -> bool:
    """``torch.cuda.is_initialized()`` without its Python overhead."""
    return _CUDA and bool(getattr(torch.cuda, "_initialized", True))


_NO_DEVICES_TYPES = ("cpu", "cuda") if _CUDA else ("cpu",)


def _autocast_types(devices: tuple[torch.device, ...]) -> tuple[str, ...]:
    """The device types whose autocast state a region with inputs on
    ``devices`` records (:data:`_NO_DEVICES_TYPES` where there are none)."""
    types = {"cpu": None, "cuda": None} if _CUDA else {"cpu": None}
    for d in devices:
        types[d.type] = None
    return tuple(types)


def _default_device() -> torch.device | None:
    """The ``torch.device(...)`` context in force, or None when there is none
    (cheap: no mode on the torch-function stack means no device context)."""
    if torch._C._len_torch_function_stack() == 0:
        return None
    return torch.get_default_device()


# Global switches that choose which kernel runs or how it computes: attention
# backends (``sdpa_kernel``), cuDNN, TF32 and matmul precision, deterministic
# algorithms, oneDNN, the default dtype. A recompute that runs with other values
# than the forward may take another path and save other tensors (or compute
# other values), so each region records them and its recompute runs under them.
# (getter, setter) names in torch._C, and whether the switch can change what runs
# on the CPU; a build or version without a switch skips it.
_C_SWITCHES = (
    ("_get_mkldnn_enabled", "_set_mkldnn_enabled", True),
    ("_get_mkldnn_deterministic", "_set_mkldnn_deterministic", True),
    ("_get_nnpack_enabled", "_set_nnpack_enabled", True),
    ("_get_flash_sdp_enabled", "_set_sdp_use_flash", True),
    ("_get_math_sdp_enabled", "_set_sdp_use_math", True),
    ("_get_math_sdp_allow_fp16_bf16_reduction",
     "_set_math_sdp_allow_fp16_bf16_reduction", True),
    ("_get_cpu_allow_fp16_reduced_precision_reduction",
     "_set_cpu_allow_fp16_reduced_precision_reduction", True),
    ("_get_cudnn_enabled", "_set_cudnn_enabled", False),
    ("_get_cudnn_deterministic", "_set_cudnn_deterministic", False),
    ("_get_cudnn_benchmark", "_set_cudnn_benchmark", False),
    ("_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient", False),
    ("_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn", False),
    ("_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable", False),
    ("_get_fa3_sdp_enabled", "_set_sdp_use_fa3", False),
    ("_get_cublas_allow_fp16_reduced_precision_reduction",
     "_set_cublas_allow_fp16_reduced_precision_reduction", False),
    ("_get_cublas_allow_bf16_reduced_precision_reduction",
     "_set_cublas_allow_bf16_reduced_precision_reduction", False),
    ("_get_cublas_allow_fp16_accumulation",
     "_set_cublas_allow_fp16_accumulation", False),
    ("_get_linalg_preferred_backend", "_set_linalg_preferred_backend", False),
    ("_get_blas_preferred_backend", "_set_blas_preferred_backend", False),
)  # fmt: skip
# The TF32 switches of the fp32-precision API (the legacy allow_tf32 flags are
# views of these, and their getters raise when the two APIs were mixed).
_FP32_OPS = (
    ("generic", "all", True),
    ("mkldnn", "matmul", True),
    ("mkldnn", "conv", True),
    ("mkldnn", "rnn", True),
    ("cuda", "matmul", False),
    ("cudnn", "conv", False),
    ("cudnn", "rnn", False),
)

Switch = tuple[Callable[[], Any], Callable[[Any], None]]


def _set_deterministic(mode: bool) -> None:
    warn_only = torch._C._get_deterministic_algorithms_warn_only()
    torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


def _set_deterministic_warn_only(warn_only: bool) -> None:
    mode = torch._C._get_deterministic_algorithms()
    torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


_MIXED = "mixed"  # the legacy matmul precision after both APIs were used


def _matmul_precision() -> str:
    try:
        value: str = torch._C._get_float32_matmul_precision()
    except RuntimeError:  # torch raises once legacy and new TF32 APIs are mixed
        return _MIXED
    return value


def _set_matmul_precision(value: str) -> None:
    if value != _MIXED:
        torch._C._set_float32_matmul_precision(value)


def _spread(put: Callable[..., None]) -> Callable[[Any], None]:
    """A setter taking what its getter returns: the cuBLAS reduced-precision
    getters return (allowed, split_k) and their setters take two arguments."""

    def set_value(value: Any) -> None:
        if isinstance(value, tuple):
            put(*value)
        else:
            put(value)

    return set_value


def _switches() -> tuple[list[Switch], list[Switch]]:
    """(the switches that matter on the CPU, all switches) of this build."""
    c = torch._C
    candidates: list[tuple[Any, Any, bool]] = [
        (torch.get_default_dtype, torch.set_default_dtype, True),
        (c._get_deterministic_algorithms, _set_deterministic, True),
        (
            c._get_deterministic_algorithms_warn_only,
            _set_deterministic_warn_only,
            True,
        ),
    ]
    for get_name, set_name, cpu in _C_SWITCHES:
        get, put = getattr(c, get_name, None), getattr(c, set_name, None)
        if get is not None and put is not None:
            candidates.append((get, _spread(put), cpu))
    # The legacy matmul precision before the fp32-precision switches: setting it
    # moves them too, and those still different afterwards are set one by one.
    candidates.append((_matmul_precision, _set_matmul_precision, True))
    if hasattr(c, "_get_fp32_precision_getter"):
        for backend, op, cpu in _FP32_OPS:
            candidates.append(
                (
                    functools.partial(c._get_fp32_precision_getter, backend, op),
                    functools.partial(c._set_fp32_precision_setter, backend, op),
                    cpu,
                )
            )
    if hasattr(c, "_get_sdp_priority_order"):  # a list of backend numbers
        candidates.append((c._get_sdp_priority_order, c._set_sdp_priority_order, True))
    usable: list[tuple[Any, Any, bool]] = []
    for get, put, cpu in candidates:
        try:
            get()  # switches this build lacks raise here (e.g. no cuDNN)
        except (AttributeError, RuntimeError):
            continue
        usable.append((get, put, cpu))
    return (
        [(get, put) for get, put, cpu in usable if cpu],
        [(get, put) for get, put, _ in usable],
    )


CPU_SWITCHES, ALL_SWITCHES = _switches()


_any_autocast: Callable[[], bool] = getattr(
    torch._C, "_is_any_autocast_enabled", lambda: True
)


def _autocast(types: tuple[str, ...]) -> tuple[Any, ...]:
    """Autocast per device type (enabled, dtype) and the cache flag. Asked only
    where ``_any_autocast()`` (one call) says autocast is on somewhere; where it
    is off everywhere, the common case, the state is None."""
    state: list[Any] = [torch.is_autocast_cache_enabled()]
    for t in types:
        state += (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
    return tuple(state)


def _reader(getters: list[Callable[[], Any]]) -> Callable[[], tuple[Any, ...]]:
    """One function that calls every getter and returns their values as a
    tuple: read twice per region, so written out call by call (a partial's
    function is called with its constant arguments) instead of looped over."""
    names: dict[str, Any] = {}
    calls = []
    for i, get in enumerate(getters):
        if isinstance(get, functools.partial) and not get.keywords:
            names[f"f{i}"] = get.func
            calls.append(f"f{i}({', '.join(map(repr, get.args))})")
        else:
            names[f"f{i}"] = get
            calls.append(f"f{i}()")
    read: Callable[[], tuple[Any, ...]] = eval(  # noqa: S307 (our own names only)
        f"lambda: ({', '.join(calls)},)", names
    )
    return read


# The default device and the switch values, per "the CPU only" or "all devices"
_READ: dict[bool, Callable[[], tuple[Any, ...]]] = {
    cpu_only: _reader([_default_device] + [get for get, _ in switches])
    for cpu_only, switches in ((True, CPU_SWITCHES), (False, ALL_SWITCHES))
}


# What Ambient.undo needs: the contexts entered, the switches set with their
# values before, and parametrize's cache switch and cache before (None where
# the cache was off then and is off now)
AmbientUndo = tuple[
    ExitStack | None,
    Sequence[tuple[Switch, Any]],
    tuple[int, dict[Any, Any]] | None,
]


_NOTHING_CHANGED: AmbientUndo = (None, (), None)


class Ambient:
    """What a region's first run saw besides its inputs and RNG: autocast per
    device type (with the autocast cache flag), the default device of a
    ``torch.device(...)`` context, the backend switches (all of them once
    CUDA is in use, else those that matter on the CPU), and the cache of
    ``torch.nn.utils.parametrize.cached()`` where it was on (a region that
    found a weight cached must not compute it again in the recompute, and one
    that computed it first must compute it again)."""

    __slots__ = ("types", "autocast", "values", "cached")

    def __init__(self, devices: tuple[torch.device, ...]) -> None:
        self.types = types = _autocast_types(devices) if devices else _NO_DEVICES_TYPES
        self.autocast = _autocast(types) if _any_autocast() else None
        self.values = _READ[types == ("cpu",)]()
        self.cached = dict(_parametrize._cache) if _parametrize._cache_enabled else None

    @property
    def switches(self) -> list[Switch]:
        return CPU_SWITCHES if self.types == ("cpu",) else ALL_SWITCHES

    def replay(self) -> AmbientUndo:
        """Make the current state equal to what was captured; returns what
        :meth:`undo` needs."""
        types = self.types
        now = _READ[types == ("cpu",)]()
        autocast = _autocast(types) if _any_autocast() else None
        then = self.values
        if now == then and autocast == self.autocast:
            cache = self._replay_cache()
            return _NOTHING_CHANGED if cache is None else (None, (), cache)
        stack = None
        if autocast != self.autocast:
            stack = ExitStack()
            wanted = self.autocast or (True, *(x for _ in types for x in (False, None)))
            for i, t in enumerate(types):
                enabled, dtype = wanted[1 + 2 * i], wanted[2 + 2 * i]
                stack.enter_context(
                    torch.autocast(
                        t,
                        dtype=dtype or torch.get_autocast_dtype(t),
                        enabled=enabled,
                        cache_enabled=wanted[0],
                    )
                )
        if now[0] != then[0]:  # the default device
            stack = stack or ExitStack()
            stack.enter_context(torch.device(then[0] or "cpu"))
        changed = []
        for switch, value, current in zip(
            self.switches, then[1:], now[1:], strict=True
        ):
            # Read again: setting one switch can move others (the legacy matmul
            # precision moves the fp32 ones).
            if value != current and switch[0]() != value:
                switch[1](value)
                changed.append((switch, current))
        return stack, changed, self._replay_cache()

    def _replay_cache(self) -> tuple[int, dict[Any, Any]] | None:
        """parametrize's cache as the first run found it; returns the
        caller's, or None where the cache was off then and is off now (the
        common case: nothing is written)."""
        if self.cached is None and not _parametrize._cache_enabled:
            return None
        caller = (_parametrize._cache_enabled, _parametrize._cache)
        _parametrize._cache_enabled = int(self.cached is not None)
        _parametrize._cache = dict(self.cached or {})
        return caller

    @staticmethod
    def undo(token: AmbientUndo) -> None:
        """Give the caller back the state :meth:`replay` changed."""
        stack, changed, cache = token
        for (get, put), value in changed:  # in order, as replay set them
            if get() != value:
                put(value)
        if stack is not None:
            stack.close()
        if cache is not None:
            _parametrize._cache_enabled, _parametrize._cache = cache
        elif _parametrize._cache_enabled:
            # Off before the recompute, on after it: a recompute that stops
            # early skips the forward hooks of the modules it stops in, so a
            # pre-hook that turns the cache on (bitsandbytes' parametrizations
            # do) would leave it on, and filled, for good.
            _parametrize._cache_enabled, _parametrize._cache = 0, {}
