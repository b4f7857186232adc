"""Which tensors an aten op writes into.

Read off the op's schema (arguments marked as written: in-place and ``out=``
variants), plus the batch-norm kernels that update the running statistics they
are given although their schemas do not say so. Used by the dispatch modes
that must see a write before or after it happens: a policy's cache drops a
kept output an op wrote into (:mod:`seqckpt.policies`), and a region copies a
large buffer just before its first write (:mod:`seqckpt._buffers`).

Internal: nothing here is public API.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["written_by"]

# op -> (position, name) of every argument it writes into (in place or out=)
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}

# Batch norm ops that update the running statistics they are given although
# their schema does not say so: the position of their training flag (None:
# always) and those of the statistics. An op output passed as running
# statistics (InstanceNorm(track_running_stats=True) repeats its buffers per
# sample) is changed by them after it was kept.
_UNDECLARED_WRITES: dict[Any, tuple[int | None, tuple[tuple[int, str], ...]]] = {
    **{
        op.default: (5, ((3, "running_mean"), (4, "running_var")))
        for op in (
            torch.ops.aten.native_batch_norm,
            torch.ops.aten.cudnn_batch_norm,
            torch.ops.aten.miopen_batch_norm,
        )
    },
    torch.ops.aten.batch_norm_update_stats.default: (
        None,
        ((1, "running_mean"), (2, "running_var")),
    ),
}


def written_by(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors ``func`` writes into when called with these arguments.

    Example:
        >>> import torch
        >>> x, y = torch.zeros(2), torch.ones(2)
        >>> written_by(torch.ops.aten.add_.Tensor, (x, y), {}) == [x]
        True
        >>> written_by(torch.ops.aten.add.Tensor, (x, y), {})
        []
    """
    spec = _WRITES.get(func)
    if spec is None:
        spec = _WRITES[func] = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    undeclared = _UNDECLARED_WRITES.get(func)
    if undeclared is not None:
        training, stats = undeclared
        if training is None or (
            args[training] if len(args) > training else kwargs.get("training")
        ):
            spec = (*spec, *stats)
    if not spec:
        return []
    found: list[Any] = []
    for i, name in spec:
        value = args[i] if i < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found
