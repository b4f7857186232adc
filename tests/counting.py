"""Counters the tests share: aten ops run under a mode, module calls that got
past their first op (to see where a recompute stopped), and a module that
counts its calls to save less on every call after the first."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):  # type: ignore[misc]
    """Counts aten ops by name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class CountsFinished(nn.Module):
    """A matmul that counts the calls that got past it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.finished = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight  # saves x and the weight before computing
        self.finished += 1
        return y


class SavesLessTheSecondTime(nn.Module):
    """Saves two tensors on its first call and one on every later call (a
    recompute that differs from its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.exp().exp() if self.calls == 1 else x.exp() + 0
