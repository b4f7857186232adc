"""What a policy keeps: the op outputs a region with that policy holds from its
forward to its recompute, listed one by one (as JAX's ``print_saved_residuals``).

:func:`seqckpt.profile` measures a policy per layer (bytes kept, recompute
time); :func:`what_is_kept` says which results those bytes are, so a policy
can be checked or chosen by reading it: a ``names`` policy whose label was
never reached keeps nothing, a callable that answers True too often keeps
every view and cast.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from seqckpt import _state
from seqckpt._buffers import modules_of
from seqckpt._tree import storages_in, tensors_in
from seqckpt.keep import REPORTING
from seqckpt.planner.profile import sandbox
from seqckpt.policies import Keeping, Kept, Policy, as_policy, naming, uncounted_op

__all__ = ["KeptOutput", "KeptReport", "what_is_kept"]


@dataclass(frozen=True)
class KeptOutput:
    """One op output a policy keeps.

    Attributes:
        op: the aten op, as a policy names it (``"aten::addmm"``).
        call: which call of that op in the region (0: the first).
        place: its position among all the ops of the region's forward.
        shapes: the shape of each tensor the op returned.
        dtype: the dtype of its (first) tensor; None for an op that returns
            a number (``aten::_local_scalar_dense``, behind ``.item()``).
        nbytes: bytes of the distinct storages it holds that would be alive
            without it (not those of a parameter, buffer or input it is a view
            of).
        label: the :func:`seqckpt.name` label it was kept by, if any.
    """

    op: str
    call: int
    place: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None
    nbytes: int
    label: str | None = None


@dataclass(frozen=True)
class KeptReport:
    """What one policy keeps for one call of a function (see :func:`what_is_kept`).

    Attributes:
        policy: the policy.
        outputs: the kept outputs, in the order the forward made them.
        ops: how many ops the forward ran (those a policy numbers: not
            ``detach`` and the like, nor a weight's cast under autocast).
        recomputed: the ops whose outputs are not kept, with their call
            counts: what the recompute runs, at most (it stops once the last
            tensor backward needs is back).
        kept_bytes: bytes the kept outputs hold, each storage counted once (a
            kept view and its kept base share one), as :attr:`KeptOutput.nbytes`.
        kept_whole: the calls :func:`seqckpt.keep` keeps whole, in order
            (their ops are neither the policy's to keep nor recomputed).
    """

    policy: Policy
    outputs: tuple[KeptOutput, ...]
    ops: int
    recomputed: dict[str, int]
    kept_bytes: int
    kept_whole: tuple[str, ...] = ()

    def __str__(self) -> str:
        rows = [("place", "op", "call", "shape", "dtype", "KiB", "name")]
        for o in self.outputs:
            shape = ", ".join(str(tuple(s)) for s in o.shapes)
            dtype = str(o.dtype).removeprefix("torch.") if o.dtype else "-"
            rows.append(
                (
                    str(o.place),
                    o.op,
                    str(o.call),
                    shape,
                    dtype,
                    f"{o.nbytes / 2**10:.1f}",
                    o.label or "",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            f"policy {self.policy} keeps {len(self.outputs)} of {self.ops} op "
            f"outputs, {self.kept_bytes / 2**10:.1f} KiB"
        ]
        if self.outputs:
            lines += [
                "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                for r in rows
            ]
        recomputed = ", ".join(f"{op} x{n}" for op, n in self.recomputed.items())
        lines.append(f"recomputed in backward (at most): {recomputed or 'nothing'}")
        if self.kept_whole:
            calls = ", ".join(
                f"{name} x{n}"
                for name, n in collections.Counter(self.kept_whole).items()
            )
            lines.append(f"kept whole by seqckpt.keep (not recomputed): {calls}")
        return "\n".join(line.rstrip() for line in lines)


class _Recording(Keeping):  # type: ignore[no-untyped-call]
    """A region's keeping mode that also notes every op it numbers."""

    def __init__(self, policy: Policy, kept: Kept) -> None:
        super().__init__(policy, kept)
        self.ran: list[tuple[Any, int]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if not uncounted_op(func, args):
            self.ran.append((func, self.calls.get(func, 0)))
        return super().__torch_dispatch__(func, types, args, kwargs)


def what_is_kept(
    function: Callable[..., Any], *args: Any, policy: Any, **kwargs: Any
) -> KeptReport:
    """List what ``seqckpt.checkpoint(function, *args, policy=policy, **kwargs)``
    would keep in its forward.

    Runs ``function`` once with gradients on, as the forward of such a region
    (``seqckpt.is_checkpointing()`` is true inside), and puts back what that
    run changes in the modules it calls (buffers such as BatchNorm statistics,
    ``.grad``, training flags, their generators) and the global RNG state.

    Args:
        function: what the region would run (a module or any callable).
        *args: its positional arguments.
        policy: any form :func:`seqckpt.checkpoint` takes (see
            :mod:`seqckpt.policies`), not None.
        **kwargs: its keyword arguments.

    Returns:
        A :class:`KeptReport`; ``print`` it for a table.

    Raises:
        ValueError: ``policy`` is None (a region without one keeps nothing
            but its inputs).

    Example:
        >>> import torch, seqckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
        ...                             torch.nn.Linear(16, 8))
        >>> report = seqckpt.what_is_kept(block, torch.randn(4, 8),
        ...                               policy="compute_heavy")
        >>> [(o.op, o.shapes) for o in report.outputs]
        [('aten::addmm', ((4, 16),)), ('aten::addmm', ((4, 8),))]
        >>> report.recomputed
        {'aten::t': 2, 'aten::gelu': 1}
    """
    resolved = as_policy(policy)
    if resolved is None:
        raise ValueError(
            "seqckpt: what_is_kept() needs a policy, got policy=None (a region "
            "without one keeps only its inputs); pass one, e.g. "
            "policy='compute_heavy'."
        )
    mode = _Recording(resolved, Kept())
    devices = _state.accelerator_devices(tensors_in((args, kwargs)))
    phase = _state.begin(_state.CHECKPOINTING)
    kept_whole: list[str] = []
    reporting = REPORTING.set(kept_whole)
    try:
        with sandbox(devices), torch.enable_grad(), contextlib.ExitStack() as stack:
            stack.enter_context(mode)
            if resolved.names:
                stack.enter_context(naming(mode, resolved.names))
            function(*args, **kwargs)
    finally:
        REPORTING.reset(reporting)
        _state.end(_state.CHECKPOINTING, phase)
    entries = mode.kept.entries
    alive = set(storages_in((args, kwargs)))  # held anyway: inputs, parameters...
    for module in modules_of(function, None, args, kwargs):
        alive.update(storages_in([*module.parameters(), *module.buffers()]))

    def new_bytes(out: Any) -> int:
        return sum(n for s, n in storages_in(out).items() if s not in alive)

    outputs = []
    for (func, call), (out, _, place) in sorted(
        entries.items(), key=lambda item: item[1][2]
    ):
        tensors = tensors_in(out)
        outputs.append(
            KeptOutput(
                func._schema.name,
                call,
                place,
                tuple(tuple(t.shape) for t in tensors),
                tensors[0].dtype if tensors else None,
                new_bytes(out),
                mode.labels.get((func, call)),
            )
        )
    recomputed = collections.Counter(
        func._schema.name for func, call in mode.ran if (func, call) not in entries
    )
    return KeptReport(
        resolved,
        tuple(outputs),
        len(mode.ran),
        dict(recomputed),
        new_bytes([out for out, _, _ in entries.values()]),
        tuple(kept_whole),
    )
