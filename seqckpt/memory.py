"""Peak-memory measurement of a block of code, on CPU and CUDA.

CUDA has allocator statistics; the CPU has none, so on the CPU this module counts
live tensor storages itself: a dispatch mode sees every tensor an operator
returns, adds its storage's bytes the first time it sees that storage, and a
finaliser on the storage subtracts them when the storage is freed. Only
storages created inside the block count, so the figure is what the block added
on top of what was already alive (parameters, the input batch).

Also the device synchronisation every timing uses (:func:`sync_device`,
:func:`timed`) and :class:`Stopwatch`, which times calls on CUDA with events.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqckpt._tree import plain_tensors, tensors_in

__all__ = ["MemoryStats", "track_memory"]

T = TypeVar("T")


@dataclass
class MemoryStats:
    """What :func:`track_memory` measured.

    Attributes:
        device: the device measured.
        baseline_bytes: bytes allocated on the device when the block began (CUDA);
            0 on the CPU, where only the block's own allocations are seen.
        peak_bytes: the most bytes the block had allocated at once, above the
            baseline; filled in when the block ends.
        end_bytes: bytes still allocated by the block when it ended, above the
            baseline.
        peak_reserved_bytes: on CUDA, the most bytes the caching allocator held
            from the device at once (allocated plus cached, what ``nvidia-smi``
            sees), above what it held when the block began; on the CPU, equal
            to ``peak_bytes`` (there is no caching allocator to count).
    """

    device: torch.device
    baseline_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0
    peak_reserved_bytes: int = 0
    _meter: _Meter | None = field(default=None, repr=False, compare=False)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    def live_bytes(self) -> int:
        """Inside the block: bytes allocated by it so far and still alive."""
        return self._active().live()

    def peak_so_far(self) -> int:
        """Inside the block: the peak since it began or since :meth:`reset_peak`."""
        return self._active().peak()

    def reset_peak(self) -> None:
        """Inside the block: start the peak again from what is alive now, e.g. to
        measure a backward apart from its forward. ``peak_bytes`` at the end is
        the peak since the last reset."""
        self._active().reset_peak()

    def _active(self) -> _Meter:
        if self._meter is None:
            raise RuntimeError(
                "seqckpt: MemoryStats.live_bytes/peak_so_far/reset_peak work only "
                "inside its track_memory block."
            )
        return self._meter


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. Timings and
    allocator readings are taken after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """``run()``'s result and its wall-clock seconds, the device synchronised
    before and after."""
    sync_device(device)
    start = time.perf_counter()
    result = run()
    sync_device(device)
    return result, time.perf_counter() - start


class Stopwatch:
    """Times several calls on one device without a synchronisation per call.

    On CUDA each call is bracketed by two events and the elapsed times are read
    after one synchronisation at the end, so a small item is not charged the
    launch latency and the synchronisation a wall-clock timer around it would
    count. On the CPU it is ``time.perf_counter`` around each call.

    Example:
        >>> import torch
        >>> watch = Stopwatch(torch.device("cpu"))
        >>> _ = watch.run(lambda: torch.ones(8).sum())
        >>> len(watch.seconds())
        1
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def run(self, call: Callable[[], T]) -> T:
        if self.cuda:
            start, end = (
                torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                for _ in range(2)
            )
            start.record()
            result = call()
            end.record()
            self.marks.append((start, end))
        else:
            began = time.perf_counter()
            result = call()
            self.marks.append(time.perf_counter() - began)
        return result

    def seconds(self) -> list[float]:
        """The seconds of every call so far, in order."""
        if not self.cuda:
            return list(self.marks)
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in self.marks]


class _Meter:
    """Live and peak bytes above a baseline, for one device."""

    baseline = 0  # bytes already allocated when measuring began (CUDA)

    def live(self) -> int:
        raise NotImplementedError

    def peak(self) -> int:
        raise NotImplementedError

    def peak_reserved(self) -> int:
        return self.peak()

    def reset_peak(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """The block ended."""


# The CUDA meters open on each device, outermost first. The allocator has one
# peak counter per device; a meter that resets it first folds the peaks seen so
# far into the meters around it, so a nested track_memory does not hide an
# outer block's peak.
_OPEN_CUDA: dict[torch.device, list[_CudaMeter]] = {}


class _CudaMeter(_Meter):
    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self.device = device
        self.baseline = torch.cuda.memory_allocated(device)
        self.reserved_baseline = torch.cuda.memory_reserved(device)
        self.carried = self.carried_reserved = 0
        self.open = _OPEN_CUDA.setdefault(device, [])
        self._reset_device_peak()
        self.open.append(self)

    def _reset_device_peak(self) -> None:
        for outer in self.open:
            if outer is not self:
                outer.carried = max(
                    outer.carried, torch.cuda.max_memory_allocated(self.device)
                )
                outer.carried_reserved = max(
                    outer.carried_reserved, torch.cuda.max_memory_reserved(self.device)
                )
        torch.cuda.reset_peak_memory_stats(self.device)

    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.baseline

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        device_peak = torch.cuda.max_memory_allocated(self.device)
        return max(self.carried, device_peak) - self.baseline

    def peak_reserved(self) -> int:
        device_peak = torch.cuda.max_memory_reserved(self.device)
        return max(self.carried_reserved, device_peak) - self.reserved_baseline

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        self._reset_device_peak()
        self.carried = self.carried_reserved = 0

    def close(self) -> None:
        self.open.remove(self)


class _LiveStorages(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Counts the bytes of live storages created while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live_now = 0
        self.peak_now = 0
        # storage id -> a weak reference to it, which forgets it when it dies
        self.seen: dict[int, _StorageRef] = {}
        self.me = weakref.ref(self)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # most ops: one tensor
            self._count(out, args, kwargs)
        else:
            for t in tensors_in(out):
                self._count(t, args, kwargs)
        return out

    def _count(self, t: torch.Tensor, args: Any, kwargs: Any) -> None:
        if type(t) is not torch.Tensor and (inner := plain_tensors(t))[0] is not t:
            for i in inner:  # a wrapper subclass: its memory is its inner tensors
                self._count(i, args, kwargs)
            return
        if t.is_meta:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.seen or _holds(key, args) or _holds(key, kwargs.values()):
            return  # seen, or a view or in-place result: no new allocation
        ref = self.seen[key] = _StorageRef(storage, _forget)
        ref.key, ref.nbytes, ref.owner = key, storage.nbytes(), self.me
        self.live_now += ref.nbytes
        if self.live_now > self.peak_now:
            self.peak_now = self.live_now


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a counted storage, with what forgetting it needs
    (the tracker only weakly: no reference cycle through the callback)."""

    __slots__ = ("key", "nbytes", "owner")
    key: int
    nbytes: int
    owner: weakref.ref[_LiveStorages]


def _forget(ref: _StorageRef) -> None:
    tracker = ref.owner()
    if tracker is not None and tracker.seen.pop(ref.key, None) is not None:
        tracker.live_now -= ref.nbytes


def _holds(key: int, values: Any) -> bool:
    """Whether a tensor among ``values`` (or in a list, tuple or dict there, or
    inside a wrapper subclass) has the storage whose id is ``key``."""
    for v in values:
        if type(v) is torch.Tensor:
            if not v.is_meta and id(v.untyped_storage()) == key:
                return True
        elif isinstance(v, (torch.Tensor, list, tuple, dict)) and any(
            id(p.untyped_storage()) == key
            for t in tensors_in(v)
            for p in plain_tensors(t)
            if not p.is_meta
        ):
            return True
    return False


class _CpuMeter(_Meter):
    def __init__(self, mode: _LiveStorages) -> None:
        self.mode = mode

    def live(self) -> int:
        return self.mode.live_now

    def peak(self) -> int:
        return self.mode.peak_now

    def reset_peak(self) -> None:
        self.mode.peak_now = self.mode.live_now


@contextmanager
def track_memory(device: str | torch.device = "cpu") -> Iterator[MemoryStats]:
    """Measure the peak bytes that the enclosed code allocates on ``device``.

    On CUDA this uses ``torch.cuda.max_memory_allocated`` (and
    ``max_memory_reserved``) after resetting the peak; ``baseline_bytes`` is what
    was allocated before. Blocks may nest: an inner block resets the device's
    peak counter, and the outer block's peak still covers the inner one. On the
    CPU it counts live tensor storages created inside the block (see the module
    docstring); memory that kernels allocate internally without a tensor is not
    seen.

    Example:
        >>> import torch
        >>> from seqckpt import track_memory
        >>> with track_memory("cpu") as mem:
        ...     x = torch.empty(1024, dtype=torch.float32)
        ...     del x
        >>> mem.peak_bytes
        4096
    """
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"seqckpt: track_memory() measures 'cpu' or 'cuda', got device={device!r}."
        )
    mode = _LiveStorages() if dev.type == "cpu" else None
    meter: _Meter = _CpuMeter(mode) if mode is not None else _CudaMeter(dev)
    stats = MemoryStats(dev, baseline_bytes=meter.baseline, _meter=meter)
    try:
        if mode is None:
            yield stats
        else:
            with mode:
                yield stats
    finally:
        stats.peak_bytes = meter.peak()
        stats.peak_reserved_bytes = meter.peak_reserved()
        stats.end_bytes = meter.live()
        stats._meter = None
        meter.close()
