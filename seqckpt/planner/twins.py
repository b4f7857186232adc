"""Items of a chain that cost the same: one measurement serves them all.

A transformer is a stack of identical blocks, and every block costs what the
first one costs when it receives an input of the same shape. The profile
measures the first item of each kind and copies its figures to the items that
are its twins, so profiling a 24-block model costs about one block's
measurements: the others are not run at all, and the measured twin's output
stands in for theirs as the next item's input.

Two items are twins when :func:`twin_key` gives them equal keys: the same
module type and structure all the way down (submodule names and types,
parameter and buffer shapes, dtypes, devices and ``requires_grad``, training
flags, and every other attribute equal: numbers, strings and dtypes by value,
tensors by shape, dtype and device, any other object by identity), no hooks of
their own, and inputs of the same structure, shapes, strides, dtypes and
devices. An attribute that differs (a per-layer index, a dilation, a drop
rate) makes two blocks distinct: the test errs on the side of measuring.
TorchScript modules and items that are not modules (functions) are twins only
of themselves. Blocks whose cost or output shape depends on the values they
see (mixture-of-experts routing, token dropping) are twins by this test too;
profile them with ``seqckpt.profile(..., twins=False)``.

Example:
    >>> import torch
    >>> from seqckpt.planner.twins import twin_key
    >>> a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    >>> x = torch.randn(4, 8)
    >>> twin_key(a, x) == twin_key(b, x)
    True
    >>> twin_key(a, x) == twin_key(torch.nn.Linear(8, 16), x)
    False
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

__all__ = ["twin_key"]

# Module attributes that are torch's bookkeeping, not the module's behaviour.
_BOOKKEEPING = frozenset(
    {
        "training",
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
        "_is_full_backward_hook",
    }
)
# Hooks a module carries itself: a module with any is measured on its own.
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
          "_backward_pre_hooks")  # fmt: skip
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype,
          torch.device, torch.layout, torch.memory_format)  # fmt: skip


# Deeper nesting than this (or a cycle: a module holding its parent in a
# plain attribute, a list containing itself) makes the item distinct.
_DEPTH = 32


class _Distinct(Exception):
    """Raised inside :func:`twin_key` for an item that has no twins."""


def _tensor_key(t: torch.Tensor | None) -> Hashable:
    if t is None:
        return None
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, t.layout)


def _value_key(value: Any, depth: int) -> Hashable:
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return ("tensor", _tensor_key(value))
    if depth > _DEPTH:
        raise _Distinct
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return (
            type(value),
            tuple((k, _value_key(v, depth + 1)) for k, v in value.items()),
        )
    if isinstance(value, nn.Module):
        return _module_key(value, depth + 1)
    return ("object", id(value))


def _module_key(module: nn.Module, depth: int) -> Hashable:
    if isinstance(module, torch.jit.ScriptModule) or depth > _DEPTH:
        raise _Distinct
    state = vars(module)
    if any(state.get(name) for name in _HOOKS):
        raise _Distinct
    attributes = tuple(
        (name, _value_key(value, depth + 1))
        for name, value in state.items()
        if name not in _BOOKKEEPING and name not in _HOOKS
    )
    return (
        type(module),
        module.training,
        attributes,
        tuple((n, _tensor_key(p)) for n, p in module._parameters.items()),
        tuple((n, _tensor_key(b)) for n, b in module._buffers.items()),
        tuple(
            (n, None if m is None else _module_key(m, depth + 1))
            for n, m in module._modules.items()
        ),
    )


def _input_key(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return (
            "tensor",
            _tensor_key(x),
            x.stride() if x.layout == torch.strided else None,
        )
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_input_key(v) for v in x))
    if isinstance(x, dict):
        return (type(x), tuple((k, _input_key(v)) for k, v in x.items()))
    return _value_key(x, 0)


def twin_key(item: Any, x: Any) -> Hashable | None:
    """A key equal for two chain items (with their inputs) that cost the same,
    or None for an item that is measured on its own (see the module's
    description of what must match)."""
    try:
        if not isinstance(item, nn.Module):
            return (("object", id(item)), _input_key(x))
        return (_module_key(item, 0), _input_key(x))
    except _Distinct:
        return None
