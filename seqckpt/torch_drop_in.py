"""Run seqckpt where code calls torch's checkpoint functions, without editing it.

Many libraries call ``torch.utils.checkpoint.checkpoint`` through the module
when they run: timm's ``set_grad_checkpointing()`` (its ``checkpoint`` and
``checkpoint_seq`` helpers), torchvision's DenseNet with
``memory_efficient=True``, training scripts that call
``torch.utils.checkpoint.checkpoint_sequential``. Inside
:func:`replace_torch_checkpoint` those calls run :func:`seqckpt.checkpoint` and
:func:`seqckpt.checkpoint_sequential`, which take torch's arguments.

A name bound before the block by ``from torch.utils.checkpoint import
checkpoint`` keeps torch's function (HF transformers binds it so; give HF
models seqckpt as their checkpoint function instead, see the README).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint

from seqckpt.checkpoint import checkpoint
from seqckpt.sequential import checkpoint_sequential

__all__ = ["replace_torch_checkpoint"]


_LOCK = threading.Lock()
_active = 0  # blocks open, in all threads
_saved: tuple[Any, Any] = (None, None)  # torch's functions, while any is open


def replace_torch_checkpoint() -> contextlib.AbstractContextManager[None]:
    """Make ``torch.utils.checkpoint.checkpoint`` and ``checkpoint_sequential``
    seqckpt's while the block runs; torch's come back when it ends (also on an
    error).

    The replacement is process-wide, as the module attribute it sets: other
    threads see it too while a block is open. Blocks may nest and may be open
    in several threads at once; torch's functions come back when the last one
    ends. Under ``torch.compile`` nothing changes: seqckpt's checkpoint hands
    compiled code to torch's own, and a block opened inside a compiled
    function does nothing (so it does not break the graph).

    Example:
        >>> import torch, torch.utils.checkpoint, seqckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> def library_code(x):  # calls torch's checkpoint, as timm does
        ...     return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        >>> with seqckpt.replace_torch_checkpoint():
        ...     y = library_code(x)
        >>> torch.utils.checkpoint.checkpoint is seqckpt.checkpoint
        False
        >>> y.sum().backward()
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _replacing()


@contextlib.contextmanager
def _replacing() -> Iterator[None]:
    global _active, _saved
    module = _torch_checkpoint
    with _LOCK:
        if _active == 0:
            _saved = module.checkpoint, module.checkpoint_sequential
            module.checkpoint = checkpoint  # type: ignore[assignment]
            module.checkpoint_sequential = checkpoint_sequential  # type: ignore[assignment]
        _active += 1
    try:
        yield
    finally:
        with _LOCK:
            _active -= 1
            if _active == 0:
                module.checkpoint, module.checkpoint_sequential = _saved
                _saved = (None, None)
