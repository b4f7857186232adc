"""Capture and replay of the global state a recompute must see.

A checkpointed function runs twice: once in forward and once in backward. Between
the two, the caller may have moved on: drawn random numbers, left an autocast
region, changed the default device, toggled the TorchScript optimiser. This module
records what the first run saw and replays it around the second, then restores
whatever the caller had. It also owns the thread-local flags behind
:func:`seqckpt.is_checkpointing` and :func:`seqckpt.is_recomputing`.

Internal: nothing here is public API.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import ExitStack

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
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
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


# ------------------------------------------------------------- autocast and device


_CUDA = torch.cuda.is_available()


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


# Autocast per device type as (type, enabled, dtype), the autocast cache flag and
# the default device: what a region saw when it first ran.
Ambient = tuple[tuple[tuple[str, bool, torch.dtype], ...], bool, "torch.device | None"]


def capture_ambient(devices: tuple[torch.device, ...]) -> Ambient:
    return (
        tuple(
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in _autocast_types(devices)
        ),
        torch.is_autocast_cache_enabled(),
        _default_device(),
    )


def replay_ambient(ambient: Ambient, stack: ExitStack | None) -> ExitStack | None:
    """Enter the contexts that make the current autocast and default device equal
    ``ambient``. Returns the stack they were entered on (created on first need),
    or None when nothing had to be entered (the common case)."""
    autocast, cache_enabled, device = ambient
    for device_type, enabled, dtype in autocast:
        if (
            torch.is_autocast_enabled(device_type) != enabled
            or torch.get_autocast_dtype(device_type) != dtype
        ):
            stack = stack or ExitStack()
            stack.enter_context(
                torch.autocast(
                    device_type,
                    dtype=dtype,
                    enabled=enabled,
                    cache_enabled=cache_enabled,
                )
            )
    if _default_device() != device:
        stack = stack or ExitStack()
        stack.enter_context(torch.device(device or "cpu"))
    return stack


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
