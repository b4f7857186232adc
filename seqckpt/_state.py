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

import functools
import threading
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

import torch

# --------------------------------------------------------------------------- flags

_tls = threading.local()


def _depth(name: str) -> int:
    value: int = getattr(_tls, name, 0)
    return value


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
    """
    return _depth("checkpointing") > 0


def is_recomputing() -> bool:
    """Tell whether the calling code runs inside a recompute during backward.

    Thread-local and nest-safe. Useful to skip side effects (logging, counters)
    that should happen once per step.

    Example:
        >>> import torch, seqckpt
        >>> seen = []
        >>> def f(x):
        ...     seen.append(seqckpt.is_recomputing())
        ...     return x.sin()
        >>> seqckpt.checkpoint(f, torch.ones(2, requires_grad=True)).sum().backward()
        >>> seen
        [False, True]
    """
    return _depth("recomputing") > 0


def enter(name: str) -> None:
    """Increment the thread-local depth ``name`` ("checkpointing" or "recomputing")."""
    setattr(_tls, name, _depth(name) + 1)


def leave(name: str) -> None:
    """Undo one :func:`enter` of ``name``."""
    setattr(_tls, name, _depth(name) - 1)


# ----------------------------------------------------------------------------- RNG


def accelerator_devices(tensors: Iterable[torch.Tensor]) -> tuple[torch.device, ...]:
    """Non-CPU devices whose RNG a region may use: those of ``tensors`` plus the
    current CUDA device when CUDA is initialised (a region may draw on it even when
    its inputs live on the CPU)."""
    found: dict[torch.device, None] = {}
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            found[t.device] = None
    if cuda_initialized():
        found[torch.device("cuda", torch.cuda.current_device())] = None
    return tuple(found)


class RngState:
    """The CPU generator state and one state per accelerator device."""

    __slots__ = ("cpu", "devices")

    def __init__(
        self, cpu: torch.Tensor, devices: tuple[tuple[torch.device, torch.Tensor], ...]
    ) -> None:
        self.cpu = cpu
        self.devices = devices

    @staticmethod
    def capture(devices: tuple[torch.device, ...]) -> RngState:
        return RngState(
            torch.get_rng_state(),
            tuple(
                (d, torch.get_device_module(d.type).get_rng_state(d)) for d in devices
            ),
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in self.devices:
            torch.get_device_module(d.type).set_rng_state(state, d)

    def current(self) -> RngState:
        """The caller's state now, on the same devices as this one."""
        return RngState.capture(tuple(d for d, _ in self.devices))


# ------------------------------------------------ autocast, device, backend switches


_CUDA = torch.cuda.is_available()


def cuda_initialized() -> bool:
    """``torch.cuda.is_initialized()`` without its Python overhead."""
    return _CUDA and bool(getattr(torch.cuda, "_initialized", True))


def _autocast_types(devices: tuple[torch.device, ...]) -> tuple[str, ...]:
    if not devices:
        return ("cpu", "cuda") if _CUDA else ("cpu",)
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
    # The legacy matmul precision first: setting it also moves the fp32
    # precision switches, which are then set to their own captured values.
    ("_get_float32_matmul_precision", "_set_float32_matmul_precision", True),
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


def _deterministic() -> tuple[bool, bool]:
    return (
        torch._C._get_deterministic_algorithms(),
        torch._C._get_deterministic_algorithms_warn_only(),
    )


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch._C._set_deterministic_algorithms(value[0], warn_only=value[1])


def _spread(put: Callable[..., None]) -> Callable[[Any], None]:
    """A setter taking what its getter returns: the cuBLAS reduced-precision
    getters return (allowed, split_k) and their setters take two arguments."""

    def set_value(value: Any) -> None:
        if isinstance(value, tuple):
            put(*value)
        else:
            put(value)

    return set_value


def _set_priority(order: tuple[int, ...]) -> None:
    torch._C._set_sdp_priority_order(list(order))


def _priority() -> tuple[int, ...]:
    return tuple(torch._C._get_sdp_priority_order())


def _switches() -> tuple[list[Switch], list[Switch]]:
    """(the switches that matter on the CPU, all switches) of this build."""
    c = torch._C
    candidates: list[tuple[Any, Any, bool]] = [
        (torch.get_default_dtype, torch.set_default_dtype, True),
        (_deterministic, _set_deterministic, True),
    ]
    for get_name, set_name, cpu in _C_SWITCHES:
        get, put = getattr(c, get_name, None), getattr(c, set_name, None)
        if get is not None and put is not None:
            candidates.append((get, _spread(put), cpu))
    if hasattr(c, "_get_fp32_precision_getter"):
        for backend, op, cpu in _FP32_OPS:
            candidates.append(
                (
                    functools.partial(c._get_fp32_precision_getter, backend, op),
                    functools.partial(c._set_fp32_precision_setter, backend, op),
                    cpu,
                )
            )
    if hasattr(c, "_get_sdp_priority_order"):
        candidates.append((_priority, _set_priority, True))
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


def _read(switches: list[Switch]) -> list[Any]:
    return [get() for get, _ in switches]


class Ambient:
    """What a region's first run saw besides its inputs and RNG: autocast per
    device type (with the autocast cache flag), the default device of a
    ``torch.device(...)`` context, and the backend switches (all of them once
    CUDA is in use, else those that matter on the CPU)."""

    __slots__ = ("autocast", "cache", "device", "switches", "values")

    def __init__(self, devices: tuple[torch.device, ...]) -> None:
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in _autocast_types(devices)
        ]
        self.cache = torch.is_autocast_cache_enabled()
        self.device = _default_device()
        self.switches = ALL_SWITCHES if devices else CPU_SWITCHES
        self.values = _read(self.switches)

    def replay(self) -> tuple[ExitStack | None, list[tuple[Switch, Any]]] | None:
        """Make the current state equal to what was captured; None when it
        already is (the common case), else what :meth:`undo` needs."""
        now = _read(self.switches)
        autocast_same = all(
            torch.is_autocast_enabled(t) == enabled
            and torch.get_autocast_dtype(t) == dtype
            for t, enabled, dtype in self.autocast
        )
        device = _default_device()
        if now == self.values and autocast_same and device == self.device:
            return None
        stack = None
        if not autocast_same:
            stack = ExitStack()
            for t, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(
                        t, dtype=dtype, enabled=enabled, cache_enabled=self.cache
                    )
                )
        if device != self.device:
            stack = stack or ExitStack()
            stack.enter_context(torch.device(self.device or "cpu"))
        changed = []
        for switch, then, current in zip(self.switches, self.values, now, strict=True):
            if then != current:
                switch[1](then)
                changed.append((switch, current))
        return stack, changed

    @staticmethod
    def undo(token: tuple[ExitStack | None, list[tuple[Switch, Any]]] | None) -> None:
        """Give the caller back the state :meth:`replay` changed."""
        if token is None:
            return
        stack, changed = token
        for (_, put), value in reversed(changed):
            put(value)
        if stack is not None:
            stack.close()


# ---------------------------------------------------------------------- TorchScript


def plain_torchscript() -> bool:
    """Make TorchScript code run unoptimised; return the previous setting, to be
    given back to :func:`restore_torchscript`.

    The profiling executor runs a different graph on a module's first calls than
    on later ones (it saves 5 tensors, then 7, for a two-layer MLP), which would
    make a recompute disagree with its forward. The unoptimised executor always
    runs the same graph. ``torch.jit.optimized_execution`` wraps the same two
    calls in a generator context manager, too slow for a per-layer hot path.
    """
    previous: bool = torch._C._get_graph_executor_optimize()
    torch._C._set_graph_executor_optimize(False)
    return previous


def restore_torchscript(previous: bool) -> None:
    torch._C._set_graph_executor_optimize(previous)
