"""What a chain is: the items of an ``nn.Sequential``, ``nn.ModuleList``, list or
tuple, each a module or a callable. Shared by the executor and the planner, so
neither imports the other. Internal: nothing here is public API."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["Chain", "as_chain"]

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
