"""Fingerprints of saved tensors, for ``determinism_check="values"``: three
float64 numbers per tensor that change when any of its values does, taken
without copying it and compared once per region.

Example:
    >>> import torch
    >>> a = torch.arange(6.0).reshape(2, 3)
    >>> b = a.clone()
    >>> b[1, 2] += 1
    >>> first_mismatch([fingerprint(a), fingerprint(a)], [fingerprint(a), fingerprint(b)])
    1
"""

from __future__ import annotations

import math

import torch

from seqckpt._tree import plain_tensors


def fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """Three float64 numbers that change when any value of ``t`` does: the sum,
    and position-weighted sums of its sums along two groups of dimensions.
    Reductions accumulate in float64 without a float64 copy of ``t``; the only
    temporaries are the two vectors of partial sums. A wrapper subclass
    (DTensor) is read through the tensors that hold its data (a rank's shard):
    their fingerprints, summed with weights.

    None (checked by shape only) for what has no comparable values: sparse,
    quantized, meta and empty tensors, and byte workspaces (a flat uint8
    tensor: the workspace oneDNN's LSTM saves on the CPU, cuDNN's RNN and
    batch norm reserve), which hold bytes the kernel leaves unwritten."""
    inner = plain_tensors(t)
    if inner[0] is not t:
        prints = [p for p in map(fingerprint, inner) if p is not None]
        if not prints:
            return None
        return torch.stack([i * p for i, p in enumerate(prints, 1)]).sum(dim=0)
    if (
        t.is_sparse
        or t.is_quantized
        or t.is_meta
        or t.numel() == 0
        or (t.dtype is torch.uint8 and t.dim() == 1)
    ):
        return None
    x = t.detach()
    if x.is_complex():
        # (a conjugate view is read as its values: a copy, for these only)
        x = torch.view_as_real(x.resolve_conj())
    if x.dim() < 2:
        n = x.numel()
        width = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        x = x.reshape(n // width, width)
    k = _balanced_split(x.shape)
    f64 = torch.float64
    rows = x.sum(dim=tuple(range(k, x.dim())), dtype=f64).reshape(-1)
    cols = x.sum(dim=tuple(range(k)), dtype=f64).reshape(-1)
    return torch.stack(
        (
            rows.sum(),
            (
                rows * torch.arange(1, rows.numel() + 1, dtype=f64, device=x.device)
            ).sum(),
            (
                cols * torch.arange(1, cols.numel() + 1, dtype=f64, device=x.device)
            ).sum(),
        )
    )


def _balanced_split(shape: torch.Size) -> int:
    """The ``k`` in 1..ndim-1 for which dimensions ``[:k]`` and ``[k:]`` hold
    the most even numbers of elements."""
    total = math.prod(shape)
    left, best, best_k = 1, None, 1
    for k in range(1, len(shape)):
        left *= shape[k - 1]
        worst = max(left, total // left if left else 0)
        if best is None or worst < best:
            best, best_k = worst, k
    return best_k


def first_mismatch(
    before: list[torch.Tensor | None], after: list[torch.Tensor | None]
) -> int | None:
    """Index of the first saved tensor whose fingerprints differ. When none
    does, this costs one device synchronisation per device the fingerprints
    live on (one ``bool`` of a comparison of all of them at once)."""
    groups: dict[torch.device, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]]
    groups = {}
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        if a is not None and b is not None:
            indices, xs, ys = groups.setdefault(a.device, ([], [], []))
            indices.append(i)
            xs.append(a)
            ys.append(b)
    found: list[int] = []
    for indices, xs, ys in groups.values():
        a, b = torch.stack(xs), torch.stack(ys)
        differs = ((a != b) & ~(a.isnan() & b.isnan())).any(dim=1)
        if bool(differs.any()):  # the one synchronisation
            found.extend(indices[i] for i in differs.nonzero().flatten().tolist())
    return min(found) if found else None
