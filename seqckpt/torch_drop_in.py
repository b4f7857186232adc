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
import contextvars
import dataclasses
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint

from seqckpt._options import Options, make_options
from seqckpt.checkpoint import checkpoint
from seqckpt.sequential import checkpoint_sequential

__all__ = ["replace_torch_checkpoint"]


_LOCK = threading.Lock()
_active = 0  # blocks open, in all threads
_saved: tuple[Any, Any] = (None, None)  # torch's functions, while any is open

# seqckpt's keywords a block gives the calls made in it (per thread: a context
# variable), merged over the blocks open around it: the fields of Options
_OPTION_NAMES = tuple(field.name for field in dataclasses.fields(Options))
_BLOCK_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "seqckpt_block_options", default=None
)


def replace_torch_checkpoint(**options: Any) -> contextlib.AbstractContextManager[None]:
    """Make ``torch.utils.checkpoint.checkpoint`` and ``checkpoint_sequential``
    seqckpt's while the block runs; torch's come back when it ends (also on an
    error).

    Args:
        **options: keywords of :func:`seqckpt.checkpoint` for every call made in
            the block by this thread: ``policy``, ``determinism_check``,
            ``early_stop``, ``debug``, ``preserve_rng_state``, ``context_fn``,
            ``respect_saved_tensors_hooks`` (the fields of its options).
            A keyword the call passes itself wins (a library's
            ``preserve_rng_state=True`` stays); nested blocks add to the
            options of the blocks around them. Checked when the block opens.

    Raises:
        TypeError: an option that is not one of those above, or a flag that is
            not a bool.
        ValueError: an unknown ``determinism_check``, or both ``policy`` and
            ``context_fn``.

    The replacement is process-wide, as the module attribute it sets: other
    threads see it too while a block is open (with their own blocks' options).
    Blocks may nest and may be open in several threads at once; torch's
    functions come back when the last one ends. Under ``torch.compile``
    nothing changes: seqckpt's checkpoint hands compiled code to torch's own
    (without the block's options), and a block opened inside a compiled
    function does nothing (so it does not break the graph).

    Example:
        >>> import torch, torch.utils.checkpoint, seqckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> def library_code(x):  # calls torch's checkpoint, as timm does
        ...     return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        >>> with seqckpt.replace_torch_checkpoint(policy="compute_heavy"):
        ...     y = library_code(x)  # keeps the matmul's output, recomputes GELU
        >>> torch.utils.checkpoint.checkpoint is seqckpt.checkpoint
        False
        >>> y.sum().backward()
    """
    unknown = [name for name in options if name not in _OPTION_NAMES]
    if unknown:
        raise TypeError(
            f"seqckpt: replace_torch_checkpoint() got an unknown option "
            f"{unknown[0]!r}; it takes the keywords of seqckpt.checkpoint: "
            f"{', '.join(_OPTION_NAMES)}."
        )
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    make_options(**options)  # bad values fail here, not at the first call
    return _replacing(options)


def _with_block_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's keywords over the options of the blocks open in this thread."""
    if torch.compiler.is_compiling():  # (dynamo cannot read a context variable)
        return kwargs
    given = _BLOCK_OPTIONS.get()
    return {**given, **kwargs} if given else kwargs


@functools.wraps(checkpoint)
def _checkpoint_in_block(function: Any = None, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(function, *args, **_with_block_options(kwargs))


@functools.wraps(checkpoint_sequential)
def _checkpoint_sequential_in_block(
    functions: Any, segments: Any, input: Any, use_reentrant: Any = None, **kwargs: Any
) -> Any:
    return checkpoint_sequential(
        functions, segments, input, use_reentrant, **_with_block_options(kwargs)
    )


@contextlib.contextmanager
def _replacing(options: dict[str, Any]) -> Iterator[None]:
    global _active, _saved
    module = _torch_checkpoint
    with _LOCK:
        if _active == 0:
            _saved = module.checkpoint, module.checkpoint_sequential
            module.checkpoint = _checkpoint_in_block
            module.checkpoint_sequential = _checkpoint_sequential_in_block  # type: ignore[assignment]
        _active += 1
    token = _BLOCK_OPTIONS.set({**(_BLOCK_OPTIONS.get() or {}), **options})
    try:
        yield
    finally:
        _BLOCK_OPTIONS.reset(token)
        with _LOCK:
            _active -= 1
            if _active == 0:
                module.checkpoint, module.checkpoint_sequential = _saved
                _saved = (None, None)
