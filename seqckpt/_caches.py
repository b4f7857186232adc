"""Key/value caches among a region's arguments.

A transformer layer given a cache object (HF transformers' ``DynamicCache``
and its other ``Cache`` classes) appends its keys and values to it and attends
over all the cache then holds. A recompute calling the layer again would
append them a second time and attend over both: a shape error in most models,
other keys in a sliding window, and a cache that holds every entry twice for
whoever reads it back. So a region copies the structure of each cache among
its arguments when it starts (the cache object, the objects of its parts and
their lists and dicts; tensors are shared, so the copy costs no tensor
memory; counters, tensors of a few elements, are copied by value), and each
recompute runs on a fresh copy of that: the caller's cache is filled once, as
without checkpointing, and the recompute sees the cache the forward saw.
Parts a layer creates when it first writes (HF's ``StaticCache`` makes its
tensors at the first update) are created again in the copy.

A cache whose larger tensors exist when the region starts and are then
written in place (a recurrent state carried over from an earlier call) cannot
be put back this way: the recompute then stops with an error that says to
pass ``use_cache=False``.

Internal: nothing here is public API.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from seqckpt._buffers import _LEAVES  # argument types that hold nothing

__all__ = ["CacheCopies", "is_cache"]

# Tensors of at most this many elements are copied by value (the counters
# HF's caches add to in place: cumulative lengths); larger ones are shared and
# must not be written in place after the region starts.
_BY_VALUE = 64


def is_cache(value: object) -> bool:
    """A cache object a layer appends to: a class named ``...Cache`` in its
    bases (HF's ``Cache`` classes, a model's own
    ``HybridMambaAttentionDynamicCache``; a legacy tuple of tensors is never
    changed), other than a module (its state is the buffer guard's)."""
    return (
        type(value) not in _LEAVES
        and any(c.__name__.endswith("Cache") for c in type(value).__mro__)
        and not isinstance(value, torch.nn.Module)
    )


def _part_of_cache(value: object) -> bool:
    """An object copied with the cache: the cache and the objects of its parts
    (HF's per-layer ``DynamicLayer``: a ``CacheLayerMixin``), whose attributes
    the layers replace."""
    return (
        hasattr(value, "__dict__")
        and any("Cache" in c.__name__ for c in type(value).__mro__)
        and not isinstance(value, torch.nn.Module)
    )


def _copy(value: Any, memo: dict[int, Any], tensors: list[torch.Tensor] | None) -> Any:
    """``value`` with its lists, tuples, dicts, cache objects and counters
    (tensors of a few elements) copied and everything else shared; the
    tensors shared are added to ``tensors``."""
    kind = type(value)
    if kind in (list, tuple, dict) or (kind not in _LEAVES and _part_of_cache(value)):
        done = memo.get(id(value))
        if done is not None:
            return done
        made: Any
        if kind is list:
            made = memo[id(value)] = []
            made.extend(_copy(v, memo, tensors) for v in value)
        elif kind is tuple:
            made = memo[id(value)] = tuple(_copy(v, memo, tensors) for v in value)
        elif kind is dict:
            made = memo[id(value)] = {}
            made.update((k, _copy(v, memo, tensors)) for k, v in value.items())
        else:
            made = memo[id(value)] = object.__new__(kind)
            made.__dict__.update(
                (k, _copy(v, memo, tensors)) for k, v in vars(value).items()
            )
        return made
    if isinstance(value, torch.Tensor):
        if value.numel() <= _BY_VALUE:
            return value.clone()
        if tensors is not None:
            tensors.append(value)
    return value


class CacheCopies:
    """The caches among one call's arguments, as they were when it started.

    Example:
        >>> import torch
        >>> class ToyCache:
        ...     def __init__(self): self.keys = []
        >>> cache = ToyCache()
        >>> def layer(x, cache):
        ...     cache.keys.append(x)
        ...     return x * len(cache.keys)
        >>> copies = CacheCopies.of(layer, (torch.ones(1),), {"cache": cache})
        >>> layer(torch.ones(1), cache=cache)  # the forward fills the caller's
        tensor([1.])
        >>> fn, args, kwargs = copies.arguments(layer, (torch.ones(1),), {"cache": cache})
        >>> fn(*args, **kwargs), len(cache.keys)  # a recompute runs on a copy
        (tensor([1.]), 1)
    """

    __slots__ = ("where", "structure", "versions")

    def __init__(
        self, where: list[tuple[int, int | str]], caches: list[object]
    ) -> None:
        # (0: args, 1: kwargs, 2: a partial's args, 3: its keywords; position)
        self.where = where
        tensors: list[torch.Tensor] = []
        self.structure = _copy(caches, {}, tensors)
        self.versions = [(t, t._version) for t in tensors]

    @classmethod
    def of(
        cls, function: object, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> CacheCopies | None:
        """The caches among ``args`` and ``kwargs`` (and the arguments bound
        by a ``functools.partial`` ``function``, as HF's layers call their
        checkpoint function), or None where there is none."""
        partial = type(function) is functools.partial
        if not (kwargs or partial):
            for a in args:
                if type(a) not in _LEAVES:
                    break
            else:
                return None  # (the usual call: tensors only)
        sources: list[tuple[int, Any]] = [(0, enumerate(args))]
        if kwargs:
            sources.append((1, kwargs.items()))
        if partial:
            sources.append((2, enumerate(function.args)))  # type: ignore[attr-defined]
            sources.append((3, function.keywords.items()))  # type: ignore[attr-defined]
        where: list[tuple[int, int | str]] = []
        caches: list[object] = []
        for source, items in sources:
            for key, value in items:
                if is_cache(value):
                    where.append((source, key))
                    caches.append(value)
        return cls(where, caches) if caches else None

    def changed(self) -> str | None:
        """What was written in place into a tensor of the caches since they
        were copied, or None."""
        for i, (t, version) in enumerate(self.versions):
            if t._version != version:
                return f"tensor #{i} (shape {tuple(t.shape)})"
        return None

    def arguments(
        self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """``function``, ``args`` and ``kwargs`` with a fresh copy of each
        cache as it was when the call started."""
        copies = _copy(self.structure, {}, None)
        parts: list[Any] = [list(args), dict(kwargs), None, None]
        if type(function) is functools.partial:
            parts[2], parts[3] = list(function.args), dict(function.keywords)
        for (source, key), copy in zip(self.where, copies):  # noqa: B905
            parts[source][key] = copy
        if parts[2] is not None:
            function = functools.partial(function.func, *parts[2], **parts[3])
        return function, tuple(parts[0]), parts[1]
