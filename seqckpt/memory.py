"""Peak-memory measurement of a block of code, on CPU and CUDA.

CUDA has allocator statistics; the CPU has none, so on the CPU this module counts
live tensor storages itself: a dispatch mode sees every tensor an operator
returns, adds its storage's bytes the first time it sees that storage, and a
finaliser on the storage subtracts them when the storage is freed. Only
storages created inside the block count, so the figure is what the block added
on top of what was already alive (parameters, the input batch).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqckpt._tree import tensors_in

__all__ = ["MemoryStats", "track_memory"]


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
    """

    device: torch.device
    baseline_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


class _LiveStorages(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Counts the bytes of live storages created while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self.seen: dict[int, int] = {}

    def _forget(self, key: int, nbytes: int) -> None:
        if self.seen.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: set[int] | None = None
        for t in tensors_in(out):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self.seen:
                continue
            if inputs is None:
                inputs = {
                    id(i.untyped_storage())
                    for i in tensors_in((args, kwargs))
                    if i.device.type != "meta"
                }
            if key in inputs:  # a view or in-place result: no new allocation
                continue
            nbytes = storage.nbytes()
            self.seen[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._forget, key, nbytes)
        return out


@contextmanager
def track_memory(device: str | torch.device = "cpu") -> Iterator[MemoryStats]:
    """Measure the peak bytes that the enclosed code allocates on ``device``.

    On CUDA this uses ``torch.cuda.max_memory_allocated`` after resetting the
    peak; ``baseline_bytes`` is what was allocated before. On the CPU it counts
    live tensor storages created inside the block (see the module docstring);
    memory that kernels allocate internally without a tensor is not seen.

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
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        stats = MemoryStats(dev, baseline_bytes=baseline)
        try:
            yield stats
        finally:
            torch.cuda.synchronize(dev)
            stats.peak_bytes = torch.cuda.max_memory_allocated(dev) - baseline
            stats.end_bytes = torch.cuda.memory_allocated(dev) - baseline
        return
    if dev.type != "cpu":
        raise ValueError(
            f"seqckpt: track_memory() measures 'cpu' or 'cuda', got device={device!r}."
        )
    stats = MemoryStats(dev)
    mode = _LiveStorages()
    try:
        with mode:
            yield stats
    finally:
        stats.peak_bytes = mode.peak
        stats.end_bytes = mode.live
