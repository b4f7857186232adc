"""What a chain is: the items of an ``nn.Sequential``, ``nn.ModuleList``, list or
tuple, each a module or a callable. Shared by the executor and the planner, so
neither imports the other. Internal: nothing here is public API."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["Chain", "as_chain"]

Chain = nn.Sequential | nn.ModuleList | Sequence[Callable[[Any], Any]]


def as_chain(modules: object, argument: str = "modules") -> list[Callable[[Any], Any]]:
    """The items of ``modules`` as a list, checked: non-empty, all callable;
    ``argument``: what error messages call it (the caller's parameter)."""
    if isinstance(modules, (nn.Sequential, nn.ModuleList, list, tuple)):
        items = list(modules)
    else:
        raise TypeError(
            f"seqckpt: argument '{argument}' must be an nn.Sequential, "
            "nn.ModuleList, list or tuple of modules or callables, got "
            f"{type(modules).__name__}."
        )
    if not items:
        raise ValueError(
            f"seqckpt: argument '{argument}' is an empty chain; give at least one "
            "module."
        )
    for i, item in enumerate(items):
        if not callable(item):
            raise TypeError(
                f"seqckpt: {argument}[{i}] is not callable: {item!r} "
                f"({type(item).__name__}); every item of the chain must be a module "
                "or a function."
            )
    return items
