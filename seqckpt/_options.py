"""The options of a checkpoint call, checked once, and the error a region raises.

Example:
    >>> from seqckpt._options import DEFAULT_OPTIONS, make_options
    >>> make_options() is DEFAULT_OPTIONS
    True
    >>> make_options(policy="compute_heavy").policy.label
    'compute_heavy'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch.utils.checkpoint as _torch_checkpoint

from seqckpt.policies import Policy, as_policy

DeterminismCheck = Literal["default", "values", "none"]
_CHECKS = ("default", "values", "none")
ContextFn = Callable[
    [], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]
]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """Raised when a recompute does not reproduce what its forward saved, or when
    the inputs of a checkpointed region were modified in place before backward.

    A subclass of ``torch.utils.checkpoint.CheckpointError`` (a ``RuntimeError``),
    so code that catches torch's error catches this one too."""

    __module__ = "seqckpt"  # its public name, in tracebacks and pickles


@dataclasses.dataclass(frozen=True)
class Options:
    """How regions run, checked once (see :func:`seqckpt.checkpoint` for each)."""

    preserve_rng_state: bool = True
    determinism_check: DeterminismCheck = "default"
    context_fn: ContextFn | None = None
    debug: bool = False
    early_stop: bool = True
    policy: Policy | None = None
    respect_saved_tensors_hooks: bool | None = None


DEFAULT_OPTIONS = Options()


def make_options(
    *,
    preserve_rng_state: object = True,
    determinism_check: object = "default",
    context_fn: object = None,
    debug: object = False,
    early_stop: object = True,
    use_reentrant: object = None,
    policy: object = None,
    respect_saved_tensors_hooks: object = None,
) -> Options:
    """Check the options of a checkpoint call; the default options are shared."""
    for name, value in (
        ("preserve_rng_state", preserve_rng_state),
        ("debug", debug),
        ("early_stop", early_stop),
    ):
        if not isinstance(value, bool):
            raise TypeError(
                f"seqckpt: argument '{name}' must be True or False, got {value!r}."
            )
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(
            "seqckpt: argument 'use_reentrant' must be True, False or None (it is "
            f"accepted for torch compatibility and ignored), got {use_reentrant!r}."
        )
    if respect_saved_tensors_hooks is not None and not isinstance(
        respect_saved_tensors_hooks, bool
    ):
        raise TypeError(
            "seqckpt: argument 'respect_saved_tensors_hooks' must be True, False or "
            f"None, got {respect_saved_tensors_hooks!r}."
        )
    if determinism_check not in _CHECKS:
        raise ValueError(
            "seqckpt: argument 'determinism_check' must be one of "
            f"{', '.join(repr(c) for c in _CHECKS)}, got {determinism_check!r}."
        )
    if context_fn is _torch_checkpoint.noop_context_fn:
        context_fn = None  # torch's default, passed on by wrappers: nothing to enter
    if context_fn is not None and not callable(context_fn):
        raise TypeError(
            "seqckpt: argument 'context_fn' must be a callable returning two "
            f"context managers (forward, recompute), got {context_fn!r}."
        )
    resolved = as_policy(policy)
    if resolved is not None and context_fn is not None:
        raise ValueError(
            "seqckpt: give either 'policy' or 'context_fn', not both: a policy is "
            "seqckpt's own selective saving, context_fn torch's."
        )
    options = Options(
        preserve_rng_state,  # type: ignore[arg-type]
        determinism_check,  # type: ignore[arg-type]
        context_fn,  # type: ignore[arg-type]
        debug,  # type: ignore[arg-type]
        early_stop,  # type: ignore[arg-type]
        resolved,
        respect_saved_tensors_hooks,  # type: ignore[arg-type]
    )
    return DEFAULT_OPTIONS if options == DEFAULT_OPTIONS else options


# What torch's early-stop switch held at import: None where unset; True on
# older torch (2.8 among them), whose default is True, so that there only
# set_checkpoint_early_stop(False) can be told apart from the default.
_TORCH_EARLY_STOP_DEFAULT = getattr(
    _torch_checkpoint, "_enable_checkpoint_early_stop", None
)


def with_torch_switches(options: Options) -> Options:
    """``options`` with torch's global switches applied, where one of
    ``torch.utils.checkpoint.set_checkpoint_early_stop`` and
    ``set_checkpoint_debug_enabled`` is active: as in torch, they win over the
    keywords, and a region keeps what was set when its forward ran."""
    early_stop = getattr(_torch_checkpoint, "_enable_checkpoint_early_stop", None)
    if early_stop is True and _TORCH_EARLY_STOP_DEFAULT is True:
        early_stop = None  # older torch's default, not a switch set
    debug = getattr(_torch_checkpoint, "_checkpoint_debug_enabled", None)
    if early_stop is None and debug is None:
        return options
    return dataclasses.replace(
        options,
        early_stop=options.early_stop if early_stop is None else early_stop,
        debug=options.debug if debug is None else debug,
    )
