"""Flatten nested tuples, lists and dicts to their tensors, and rebuild them.

Only these containers (and namedtuples) are opened; any other object is a leaf
that is passed through untouched. Internal: nothing here is public API.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

Rebuild = Callable[[list[torch.Tensor]], Any]


def tensors_in(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in a stable order."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return out
    if isinstance(obj, (tuple, list)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return out
    for item in items:  # (the tensors among the items without a call each)
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (tuple, list, dict)):
            tensors_in(item, out)
    return out


def copy_lists(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``args`` and ``kwargs`` with each list and dict inside them (through
    tuples, lists and dicts) copied, the items shared, or None where they hold
    none. A caller that changes a list after passing it (DenseNet appends each
    layer's output to the list of features the next layers take) would change
    what a recompute reads; the copy is what the call was given.

    Example:
        >>> features = [torch.ones(1)]
        >>> args, _ = copy_lists((features,), {})
        >>> features.append(torch.zeros(1))
        >>> len(args[0]), args[0][0] is features[0]
        (1, True)
    """
    if not kwargs:
        for a in args:
            if type(a) is not torch.Tensor and isinstance(a, (tuple, list, dict)):
                break
        else:
            return None  # (the usual call: tensors and plain values)
    found: list[bool] = []
    copied = _copied(args, found), {k: _copied(v, found) for k, v in kwargs.items()}
    return copied if found else None


def _copied(o: Any, found: list[bool]) -> Any:
    kind = type(o)
    if kind is list:
        found.append(True)
        return [_copied(i, found) for i in o]
    if kind is dict:
        found.append(True)
        return {k: _copied(v, found) for k, v in o.items()}
    if isinstance(o, tuple):
        items = [_copied(i, found) for i in o]
        if all(a is b for a, b in zip(items, o)):  # noqa: B905
            return o
        return kind(*items) if hasattr(o, "_fields") else kind(items)
    return o


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s data: ``t`` itself, or for a wrapper
    subclass such as DTensor (which has no memory of its own) its inner
    tensors, recursively."""
    if type(t) is torch.Tensor or not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(t, a) for a in attrs]  # DTensor also lists its device mesh
    return [p for i in inner if isinstance(i, torch.Tensor) for p in plain_tensors(i)]


def storages_in(obj: Any) -> dict[int, int]:
    """Bytes of every distinct non-empty storage the tensors in ``obj`` live
    in, by storage identity. Told apart by storage object, not data pointer:
    DTensor has none (its shards do) and meta and fake tensors all read 0."""
    found: dict[int, int] = {}
    for t in tensors_in(obj):
        for inner in plain_tensors(t):
            storage = inner.untyped_storage()
            if storage.nbytes():
                found[storage._cdata] = storage.nbytes()
    return found


def replace_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with its tensors, in :func:`tensors_in` order, replaced by ``tensors``.

    Written without a recursive closure on purpose: a closure that calls itself
    is a reference cycle, which would keep ``tensors`` alive until the garbage
    collector runs (activations outliving their backward).
    """
    return _rebuild(obj, iter(tensors))


def _rebuild(o: Any, it: Iterator[torch.Tensor]) -> Any:
    if isinstance(o, torch.Tensor):
        return next(it)
    if isinstance(o, tuple):
        items = [_rebuild(i, it) for i in o]
        return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
    if isinstance(o, list):
        return type(o)(_rebuild(i, it) for i in o)
    if isinstance(o, dict):
        items = [(k, _rebuild(v, it)) for k, v in o.items()]
        if type(o) is dict:
            return dict(items)
        # A copy, not type(o)(items): a subclass's constructor may take other
        # arguments (defaultdict's first is its default factory).
        new = copy.copy(o)
        for k, v in items:
            new[k] = v
        return new
    return o
