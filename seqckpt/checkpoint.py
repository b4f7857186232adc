"""The recompute primitive: :func:`checkpoint` and its error type.

How it works. The function runs once in forward with autograd on, so the real
graph is built, but under saved-tensor hooks that replace every tensor autograd
wants to keep by its index. When backward first needs one of them, the region is
run again (same RNG, autocast, default device, backend switches, buffers and
module training modes as the first time) and every tensor it saves is collected
by index; each node then gets back the tensor it saved the first time (the very
object, for tensors that do not require grad). The graph that backward walks is
the one built in forward, so ``torch.autograd.grad``, ``backward(inputs=...)``,
parameters that are not inputs, double backward, ``retain_graph`` and a backward
run *inside* the function behave as without checkpointing, and gradients are
bitwise those of the plain run.

The recompute stops as soon as the last of those tensors is back (an exception
raised in the saved-tensor hook, recognised also after TorchScript turned it
into a RuntimeError): the rest of the region would only produce an output that
is thrown away. That skips the region's last op when it saves only its inputs
(a Linear, GELU) and, in nested plans, a trailing inner region.

Differences from ``torch.utils.checkpoint(use_reentrant=False)``: TorchScript
runs unoptimised in the region so both runs save the same tensors (and the stop
works across it), module buffers (BatchNorm statistics) are updated once,
backend switches (``sdpa_kernel``, TF32, cuDNN, deterministic algorithms) are
replayed, a saved tensor unpacked twice is recomputed instead of raising, and
the bookkeeping per region is a few attribute writes, which is what makes small
regions cheap.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
import operator
import warnings
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Generic, Literal, TypeVar, overload

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from seqckpt import _state
from seqckpt import policies as _policies
from seqckpt._buffers import (
    BufferGuard,
    WriteWatch,
    _Tensor,
    is_parameter,
    modules_of,
    survey,
    watching_modules,
)
from seqckpt._caches import CacheCopies
from seqckpt._state import _GENERATOR
from seqckpt._tree import copy_lists, plain_tensors, replace_tensors, tensors_in
from seqckpt.policies import Keeping, Kept, Policy, Serving, as_policy, uncounted_op

__all__ = ["CheckpointError", "CheckpointedFunction", "checkpoint"]

# torch's own functions, as they were when seqckpt was imported: compiled code
# goes to torch's checkpoint even while seqckpt.replace_torch_checkpoint() has
# put seqckpt's in its place.
TORCH_CHECKPOINT: Callable[..., Any] = _torch_checkpoint.checkpoint
TORCH_CHECKPOINT_SEQUENTIAL: Callable[..., Any] = (
    _torch_checkpoint.checkpoint_sequential
)

DeterminismCheck = Literal["default", "values", "none"]
_CHECKS = ("default", "values", "none")
ContextFn = Callable[
    [], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]
]

T = TypeVar("T")


class CheckpointError(_torch_checkpoint.CheckpointError):
    """Raised when a recompute does not reproduce what its forward saved, or when
    the inputs of a checkpointed region were modified in place before backward.

    A subclass of ``torch.utils.checkpoint.CheckpointError`` (a ``RuntimeError``),
    so code that catches torch's error catches this one too."""


@dataclasses.dataclass(frozen=True)
class Options:
    """How regions run, checked once (see :func:`checkpoint` for each)."""

    preserve_rng_state: bool = True
    determinism_check: DeterminismCheck = "default"
    context_fn: ContextFn | None = None
    debug: bool = False
    early_stop: bool = True
    policy: Policy | None = None
    respect_saved_tensors_hooks: bool | None = None


DEFAULT_OPTIONS = Options()


@overload
def checkpoint(
    function: Callable[..., T],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: ContextFn | None = None,
    determinism_check: DeterminismCheck = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    policy: Any = None,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> T: ...


@overload
def checkpoint(
    function: None = None,
    *,
    use_reentrant: bool | None = None,
    context_fn: ContextFn | None = None,
    determinism_check: DeterminismCheck = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    policy: Any = None,
    respect_saved_tensors_hooks: bool | None = None,
) -> Callable[[Callable[..., T]], CheckpointedFunction[T]]: ...


def checkpoint(
    function: Callable[..., T] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: ContextFn | None = None,
    determinism_check: DeterminismCheck = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    policy: Any = None,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Call ``function(*args, **kwargs)`` without keeping its activations.

    The tensors autograd would keep for backward are dropped during forward and
    recomputed, by running ``function`` again, when backward needs them. Only the
    inputs are held. Gradients, outputs and module buffers are bitwise those of
    the plain call on CPU.

    It takes the keywords of ``torch.utils.checkpoint.checkpoint`` and never
    passes them on to ``function``, so it drops in where torch's is called
    (HF ``gradient_checkpointing_func``, timm, Lightning). As torch's (2.14),
    called with options only it returns a decorator:
    ``seqckpt.checkpoint(preserve_rng_state=False)(fn)`` or
    ``@seqckpt.checkpoint(policy="compute_heavy")`` on a function or method
    gives a :class:`CheckpointedFunction` that checkpoints every call.

    Args:
        function: any callable: an ``nn.Module``, a TorchScript module, a
            function; omitted (with no ``args``): return a decorator.
        *args: positional arguments; tensors may sit in nested tuples, lists and
            dicts, and need not require grad (parameters used by ``function``
            still get their gradients).
        use_reentrant: accepted for compatibility with torch and ignored:
            seqckpt has one implementation, which has none of the limits of
            torch's reentrant variant (``True``) and matches its non-reentrant
            one (``False``) in what it supports. Both values give the same
            result.
        context_fn: as in torch: a callable returning two context managers,
            the first entered around the forward, the second around each
            recompute. torch's selective checkpointing
            (``functools.partial(create_selective_checkpoint_contexts, policy)``)
            works with it unchanged.
        determinism_check: ``"default"`` raises :class:`CheckpointError` when the
            recompute saves fewer tensors than the forward, or one of another
            shape, dtype or device (it stops once all are back, so extra work
            after them is neither run nor counted); ``"values"`` runs the
            recompute to the end, checks the exact count, fingerprints each
            saved tensor (sums in float64, without copies) and compares them
            once per region, and keeps the first-run value of every
            floating-point buffer; ``"none"`` checks only that no tensor is
            missing. torch accepts ``"default"`` and ``"none"``.
        debug: record the aten ops of the forward and of the recompute, and
            name the first place they differ in a :class:`CheckpointError`.
            As in torch, ``torch.utils.checkpoint.set_checkpoint_debug_enabled``
            overrides it while active.
        early_stop: stop the recompute once every saved tensor is back (the
            default); ``False`` runs the function to its end. As in torch,
            ``torch.utils.checkpoint.set_checkpoint_early_stop`` overrides it
            for the regions whose forward runs under it.
        preserve_rng_state: replay the CPU and accelerator RNG of the first run in
            the recompute, so dropout draws the same mask. The caller's RNG after
            backward is what the plain run leaves.
        policy: what the region keeps besides its inputs (selective saving,
            see :mod:`seqckpt.policies`): None (nothing), ``"compute_heavy"``
            (matmuls, convolutions, attention), a collection of aten ops,
            ``seqckpt.policies.names(...)`` for tensors marked with
            :func:`seqckpt.name`, or a callable ``(op, *args, **kwargs) ->
            bool``. Kept outputs are served to the recompute instead of being
            computed again; under ``torch.compile`` the policy becomes torch's
            selective checkpointing (a kept name becomes a saved graph op).
        respect_saved_tensors_hooks: as in torch 2.14: whether what torch's
            selective checkpointing (``context_fn``) keeps goes through the
            user's saved-tensor hooks around the region (``save_on_cpu``);
            None keeps torch's default. A seqckpt ``policy`` keeps its
            outputs outside those hooks (torch's earlier behaviour, without
            its warning). Older torch ignores it.
        **kwargs: keyword arguments for ``function``.

    Returns:
        Whatever ``function`` returns (tensors, containers, non-tensors); a
        decorator where ``function`` is omitted.

    Raises:
        TypeError: ``function`` is not callable, a flag is not a bool, or
            keyword arguments for a function are given without one.
        ValueError: unknown ``determinism_check``.
        CheckpointError: in backward, when the recompute differs from the forward
            or an input was modified in place after the call.

    Under ``torch.no_grad()`` or ``torch.inference_mode()`` this is a plain call.
    Under ``torch.func.grad``, ``vjp``, ``jacrev`` or ``hessian``, which refuse
    saved-tensor hooks (torch's checkpoint raises there), it is a plain call
    with a warning: right gradients, no memory saved. Under ``torch.vmap``,
    ``torch.func.jvp`` and ``jacfwd`` it is a plain call as well: a backward
    through what they computed runs after they have ended, where the function
    cannot run again (torch's checkpoint fails there); it warns when an input
    or a parameter of a module it can see requires grad.
    Under ``torch.compile`` it becomes torch's own checkpoint operator, which the
    compiler turns into recomputation in the compiled backward.

    Module buffers are protected from double updates for every module the
    function calls, however it reaches it (argument, closure, container of
    modules, attribute, global): a forward pre-hook watches the first run.
    A key/value cache among the arguments (HF's ``DynamicCache``, given to a
    decoder layer) is filled once, by the forward: each recompute runs on a
    copy of the cache as it was when the call started (see ``seqckpt._caches``).

    Example:
        >>> import torch, seqckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = seqckpt.checkpoint(block, x, use_reentrant=False)
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])
    """
    if (
        context_fn is None
        and policy is None
        and determinism_check == "default"
        and debug is False
        and early_stop is True
        and preserve_rng_state is True
        and respect_saved_tensors_hooks is None
        and (use_reentrant is None or use_reentrant is True or use_reentrant is False)
    ):
        options = DEFAULT_OPTIONS  # the common call, checked cheaply
    else:
        options = make_options(
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            context_fn=context_fn,
            debug=debug,
            early_stop=early_stop,
            use_reentrant=use_reentrant,
            policy=policy,
            respect_saved_tensors_hooks=respect_saved_tensors_hooks,
        )
    if function is None and not args:
        if kwargs:
            raise TypeError(
                "seqckpt: checkpoint() without a function makes a decorator and "
                f"takes checkpoint options only, got {', '.join(sorted(kwargs))}; "
                "pass the function's own arguments when calling it."
            )
        return functools.partial(CheckpointedFunction, options=options)
    if not callable(function):
        _check_function(function)  # raises
    return run_region(function, args, kwargs, options)  # type: ignore[arg-type]


class CheckpointedFunction(Generic[T]):
    """A function checkpointed at every call: what ``checkpoint(**options)``
    (no function) returns, applied to a function, or used as a decorator, on
    methods too (as torch's curried form).

    Example:
        >>> import torch, seqckpt
        >>> @seqckpt.checkpoint(preserve_rng_state=False)
        ... def block(x):
        ...     return x.sin().cos()
        >>> x = torch.randn(3, requires_grad=True)
        >>> block(x).sum().backward()
    """

    def __init__(self, function: Callable[..., T], options: Options) -> None:
        _check_function(function)
        self.function, self.options = function, options
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        return run_region(self.function, args, kwargs, self.options)

    def __get__(self, instance: Any, owner: Any = None) -> CheckpointedFunction[T]:
        bind = getattr(self.function, "__get__", None)
        if instance is None or bind is None:
            return self
        return CheckpointedFunction(bind(instance, owner), self.options)


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


def _check_function(function: object) -> None:
    if not callable(function):
        raise TypeError(
            "seqckpt: argument 'function' must be callable (a module or a function), "
            f"got {function!r} of type {type(function).__name__}; "
            "call it as seqckpt.checkpoint(block, x)."
        )


def run_region(
    function: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: Options,
    modules: Iterable[nn.Module] | None = None,
    name: str | None = None,
    generators: Iterable[torch.Generator] = (),
) -> T:
    """:func:`checkpoint` for callers that already checked the function and
    built the options; ``modules``: the modules ``function`` runs, when the
    caller knows them (the plan executor), else they are read off ``function``;
    ``name``: what errors call it (else :func:`_name` of ``function``);
    ``generators``: ``torch.Generator`` objects the caller found on the way to
    ``modules`` (a plain callable's closure), replayed with those found here."""
    if torch.compiler.is_compiling():
        return _compiled_checkpoint(function, args, kwargs, options)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    why = None
    found = list(generators)
    if not _hooks_enabled():
        why = (
            "here: saved-tensor hooks are switched off (torch.func.grad, vjp, "
            "jacrev and hessian refuse them), so it keeps its activations. "
            "Gradients are right; to save memory, take them with "
            "torch.autograd.grad or .backward() instead."
        )
    elif _peek_transform() is not None and (transform := _forward_transform()):
        # The backward of what runs under vmap or jvp runs after the transform
        # has ended, where the function cannot run again (its batched or dual
        # tensors are gone): torch's checkpoint fails there.
        if not _needs_grad(function, args, kwargs, modules):
            return function(*args, **kwargs)
        why = (
            f"under {transform}: backward runs after the transform has ended, "
            "where the function cannot run again, so it keeps its activations. "
            "Gradients are right; to save memory, checkpoint outside the "
            "transform."
        )
    else:
        if modules is None:
            # (the walk also finds the generators among the arguments)
            runs = modules_of(function, found, args, kwargs)
        else:
            runs = list(modules)
            if _GENERATOR in set(map(type, args)):  # given: f(x, generator=g)
                _state.generators_held(args, found)
            if kwargs:
                _state.generators_held(kwargs.values(), found)
        lazy, stateful, walked, unfilled = survey(runs, found)
        if not stateful:
            runs = []  # nothing for a buffer guard to hold
        if lazy is not None:
            why = (
                f"this call: its {type(lazy).__name__} initializes its parameters "
                "now, drawing random numbers a recompute would not draw (dropout "
                "after it would get another mask). Later calls are checkpointed."
            )
    if why is not None:
        label = name or _name(function)
        warnings.warn(
            f"seqckpt: {label} runs without checkpointing {why}", stacklevel=3
        )
        return function(*args, **kwargs)
    options = _with_torch_switches(options)
    if (
        options.policy is not None
        or options.debug
        or options.determinism_check == "values"
    ):
        _warn_if_compiled(function, walked, options, name)
    result: T = _Region(
        function, args, kwargs, options, runs, name, walked, found, unfilled
    ).run()
    return result


def _warn_if_compiled(
    function: Callable[..., Any],
    walked: list[nn.Module],
    options: Options,
    name: str | None,
) -> None:
    """Warn where a region whose options need a dispatch mode (a policy,
    ``debug``) or a global module hook (``determinism_check="values"``) runs a
    module or function compiled with ``torch.compile``: torch.compile does not
    compile under a dispatch mode (the module runs eagerly), and traces the
    hook with graph breaks, so the step is slower and its numbers are not
    those of the compiled plain run. Modules are seen as the region's walk
    sees them; a compiled function called from inside a forward is not."""
    what = _compiled_part(function, walked)
    if what is None:
        return
    if options.policy is not None or options.debug:
        needs = "a policy" if options.policy is not None else "debug=True"
        how = (
            f"{needs} needs a dispatch mode, under which torch.compile does "
            "not compile: it runs eagerly"
        )
    else:
        how = (
            'determinism_check="values" watches module calls with a global '
            "hook, which torch.compile traces with graph breaks: it runs "
            "compiled in pieces"
        )
    warnings.warn(
        f"seqckpt: checkpointed {name or _name(function)} runs {what}, and {how}; "
        "the step is slower and its numbers are not those of the compiled "
        "plain run (other rounding, other dropout masks; torch's selective "
        "checkpointing behaves the same). Checkpoint the module as written and "
        "compile the checkpointed call instead, e.g. torch.compile(lambda x: "
        "seqckpt.checkpoint(block, x, policy=...)): in compiled code a policy "
        "becomes torch's own selective checkpointing.",
        stacklevel=4,
    )


def _compiled_part(function: object, walked: Iterable[nn.Module]) -> str | None:
    """What ``function`` visibly runs that is compiled with ``torch.compile``
    (itself, or a module among ``walked``), in words; None where nothing is."""
    if (
        not isinstance(function, nn.Module)  # (whose __getattr__ would raise)
        and getattr(function, "_torchdynamo_orig_callable", None) is not None
    ):
        return "a function compiled with torch.compile"
    for m in walked:
        if type(m).__name__ == "OptimizedModule":  # torch.compile(module)
            inner = getattr(m, "_orig_mod", m)
            return f"a {type(inner).__name__} compiled with torch.compile"
        if m.__dict__.get("_compiled_call_impl") is not None:  # module.compile()
            return f"a {type(m).__name__} compiled with .compile()"
    return None


# What torch's early-stop switch held at import: None where unset; True on
# older torch (2.8 among them), whose default is True, so that there only
# set_checkpoint_early_stop(False) can be told apart from the default.
_TORCH_EARLY_STOP_DEFAULT = getattr(
    _torch_checkpoint, "_enable_checkpoint_early_stop", None
)


def _with_torch_switches(options: Options) -> Options:
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


def _compiled_checkpoint(
    function: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: Options,
) -> T:
    # Dynamo turns torch's non-reentrant checkpoint into the
    # tag_activation_checkpoint operator; the partitioner then recomputes.
    extra: dict[str, Any] = {}
    if options.context_fn is not None:
        extra["context_fn"] = options.context_fn
    elif options.policy is not None:
        extra["context_fn"] = options.policy.torch_context_fn
    if options.respect_saved_tensors_hooks is not None:  # (torch 2.14 and later)
        extra["respect_saved_tensors_hooks"] = options.respect_saved_tensors_hooks
    result: T = TORCH_CHECKPOINT(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=options.preserve_rng_state,
        **extra,
        **kwargs,
    )
    return result


class _StopRecompute(Exception):
    """Raised inside a recompute once every saved tensor is back."""


class _SaveInputs(torch.autograd.Function):
    """Holds a nested region's inputs as saved tensors of a side node, so the
    saved-tensor hooks of an enclosing region (ours or anyone's) see them."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.detach()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # never reached: output unused
        return (None,) * (1 + len(ctx.saved_tensors))


class _OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Records the name of every aten op the function runs (``debug=True``):
    not seqckpt's bookkeeping (buffer replays, fingerprints, which it hides
    from modes that count ops) nor ``detach``, which seqckpt's hooks call in
    the recompute only, nor a weight's cast that autocast's cache runs in one
    pass only (see :func:`seqckpt.policies.uncounted_op`), so the two logs
    differ only where the function does."""

    counts_ops = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if not uncounted_op(func, args):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _op_difference(forward: list[str], recompute: list[str]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(forward, recompute, strict=False)) if a != b),
        min(len(forward), len(recompute)),
    )
    window = slice(max(0, at - 3), at + 3)
    return (
        "\nseqckpt debug: You are seeing this error because you passed "
        "`debug=True` to checkpoint (or torch's set_checkpoint_debug_enabled(True) "
        f"is on). The forward ran {len(forward)} ops, the recompute "
        f"{len(recompute)}; they first differ at op #{at}.\n"
        f"  forward   ops #{window.start}..: {', '.join(forward[window]) or '-'}\n"
        f"  recompute ops #{window.start}..: {', '.join(recompute[window]) or '-'}"
    )


def _fingerprint(t: torch.Tensor) -> torch.Tensor | None:
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
        prints = [p for p in map(_fingerprint, inner) if p is not None]
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


def _first_mismatch(
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


_EMPTY = torch.empty(0)

# Where a region with a policy that is created while another region runs its
# function registers (the running region's list for this pass, and whether the
# pass is that region's first forward). A nested region's recompute runs after
# its parent's; what it keeps in the parent's first forward would be held all
# that time, so it keeps nothing then, and the parent's recompute, which makes
# the region again, hands the new one's kept outputs to it.
_POLICY_CHILDREN: contextvars.ContextVar[tuple[list[_Region], bool] | None] = (
    contextvars.ContextVar("seqckpt_policy_children", default=None)
)


def _placeholders(obj: Any) -> list[torch.Tensor]:
    return [_EMPTY] * len(tensors_in(obj))


def _describe(meta: tuple[torch.Size, torch.dtype, torch.device]) -> str:
    shape, dtype, device = meta
    return f"shape {tuple(shape)}, {str(dtype).replace('torch.', '')} on {device}"


def _name(function: object) -> str:
    """What error messages call a checkpointed function: a module's class, the
    module of a bound method (HF passes ``partial(super().__call__, ...)``), a
    partial's function, or a function's qualified name."""
    if isinstance(function, nn.Module):
        return type(function).__name__
    if isinstance(function, functools.partial):
        return _name(function.func)
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return type(owner).__name__
    return getattr(function, "__qualname__", None) or type(function).__name__


class _Region:
    """One call of a checkpointed function: what it needs to run again."""

    __slots__ = (
        "function",
        "args",
        "kwargs",
        "options",
        "inputs",
        "versions",
        "saver",
        "rng",
        "ambient",
        "metas",
        "prints",
        "recomputed",
        "guard",
        "in_forward",
        "input_ids",
        "streams",
        "kept",
        "recompute_context",
        "forward_ops",
        "children",
        "keep_later",
        "name",
        "modes",
        "unfilled",
        "caches",
        "snapshot",
        "__weakref__",
    )

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: Options,
        modules: list[nn.Module] | None,
        name: str | None = None,
        walked: list[nn.Module] | None = None,
        generators: list[torch.Generator] | None = None,
        unfilled: bool = False,
    ) -> None:
        self.function = function
        # The training flag of every module the region visibly runs: a
        # recompute runs in the modes of the first run (model.eval() between
        # forward and backward would turn dropout and batch norm's batch
        # statistics off in the recompute only).
        self.modes = (walked, list(map(_training, walked))) if walked else None
        self.options = options
        self.metas: list[Any] = []
        self.prints: list[torch.Tensor | None] = []
        self.recomputed: list[torch.Tensor | None] | None = None
        self.in_forward = False
        self.recompute_context: AbstractContextManager[Any] | None = None
        self.forward_ops: list[str] | None = None
        self.kept: Kept | None = None
        # Weak: a child's saver node unpacks through this region, so strong
        # references both ways would be a cycle holding the inputs, the kept
        # outputs and the graph until the garbage collector runs.
        self.children: list[weakref.ref[_Region]] | None = None
        self.keep_later = False
        self.name = name
        if options.policy is not None:
            running = _POLICY_CHILDREN.get()
            if running is not None:
                running[0].append(self)
                self.keep_later = running[1]
        inputs = tensors_in(args) if args else []
        if kwargs:
            tensors_in(kwargs, inputs)
        devices = _state.accelerator_devices(inputs)
        self.rng = (
            _state.RngState.capture(devices, generators or ())
            if options.preserve_rng_state
            else None
        )
        self.ambient = _state.Ambient(devices)
        self.streams = _state.cuda_streams(devices) if devices else None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            # Not nested: hold the inputs directly and watch their versions.
            self.inputs: list[torch.Tensor] | None = inputs
            self.versions: list[int] | None = _versions(inputs)
            self.input_ids: set[int] | None = set(map(id, inputs))
            self.saver = None
        else:
            # Nested in another region (or other saved-tensor hooks): save the
            # inputs through them, so the enclosing region drops them as well.
            dummy = torch.empty((0,), requires_grad=True)
            self.saver = _SaveInputs.apply(dummy, *inputs)  # type: ignore[no-untyped-call]
            self.inputs = None
            self.versions = None
            self.input_ids = None
        self.args, self.kwargs = args, kwargs
        # The lists and dicts among the arguments as the call got them: the
        # forward runs on the caller's, the recompute on these (see copy_lists).
        self.snapshot = copy_lists(args, kwargs)
        if modules is None:
            modules = modules_of(function, None, args, kwargs)
        conservative = options.determinism_check == "values"
        self.guard = (
            BufferGuard.of(modules, conservative, inputs)
            if modules or conservative
            else None
        )
        if (
            self.guard is not None
            and self.guard.unwritten
            and _compiled_part(function, walked or modules) is not None
        ):
            # torch.compile does not compile under the dispatch mode that
            # copies large buffers at their first write
            self.guard.copy_deferred()
        # Whether an op saves a tensor before filling it (see _buffers.survey):
        # the recompute runs to its end, and with "values" such tensors go
        # unfingerprinted (their fingerprints would read unfilled memory).
        self.unfilled = unfilled
        # a key/value cache among the arguments, as it is before the forward
        # fills it: each recompute runs on a copy (see _caches)
        self.caches = CacheCopies.of(function, args, kwargs)

    # ------------------------------------------------------------------ forward

    def run(self) -> Any:
        options = self.options
        extra: ExitStack | None = None
        guard = self.guard
        policy = options.policy
        if (
            options.context_fn is not None
            or options.debug
            or policy is not None
            or (guard and (guard.conservative or guard.unwritten))
        ):
            # Entered one by one; if one fails (a user's context_fn), those
            # already entered are left again before the error propagates.
            with ExitStack() as setup:
                if guard is not None and guard.conservative:
                    # every module the region calls, however it reaches it
                    setup.enter_context(watching_modules(guard.watch))
                if guard is not None and guard.unwritten:
                    # large buffers, copied just before their first write
                    setup.enter_context(WriteWatch(guard))
                if options.context_fn is not None:
                    forward_context, self.recompute_context = _two_contexts(
                        options.context_fn
                    )
                    respect = options.respect_saved_tensors_hooks
                    if respect is not None and isinstance(
                        forward_context, _TORCH_SAC_CACHE
                    ):
                        # whether torch's selective checkpointing routes what it
                        # keeps through the user's saved-tensor hooks
                        forward_context.respect_saved_tensors_hooks = respect
                    setup.enter_context(forward_context)
                if policy is not None and not self.keep_later:
                    self.kept = Kept()
                    keeping = setup.enter_context(Keeping(policy, self.kept))
                    if policy.names:
                        setup.enter_context(_policies.naming(keeping, policy.names))
                if options.debug:
                    log = setup.enter_context(_OpLog())
                extra = setup.pop_all()
        phase = _state.begin(_state.CHECKPOINTING)
        lost = None
        self.in_forward = True
        children: list[_Region] = []
        running = _POLICY_CHILDREN.set((children, True))
        pack: Callable[[torch.Tensor], Any] = self._pack
        if _USER_HOOKS is not None:
            pack = _mark_internal(functools.partial(_Region._pack, self))
        torch._C._autograd._push_saved_tensors_default_hooks(pack, self._unpack)
        try:
            if extra is None:
                output = self.function(*self.args, **self.kwargs)
            else:
                with extra:
                    output = self.function(*self.args, **self.kwargs)
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            if _USER_HOOKS is not None:
                del pack._user_hooks  # type: ignore[attr-defined]
            _POLICY_CHILDREN.reset(running)
            self.children = [weakref.ref(c) for c in children] if children else None
            self.in_forward = False
            if self.snapshot is not None:
                self.args, self.kwargs = self.snapshot
                self.snapshot = None
            self.recomputed = None  # tensors recomputed for a backward run inside
            _state.end(_state.CHECKPOINTING, phase)
            if guard is not None:
                lost = guard.settle()
            if self.saver is not None:
                # The saver node holds the inputs now; drop our references.
                self.args = replace_tensors(self.args, _placeholders(self.args))
                self.kwargs = replace_tensors(self.kwargs, _placeholders(self.kwargs))
        if lost is not None:
            raise CheckpointError(lost)
        if self.inputs and _versions(self.inputs) != self.versions:
            raise CheckpointError(
                f"seqckpt: checkpointed {self._label()} modified its own "
                "input in place (e.g. nn.ReLU(inplace=True) as its first layer), so "
                "its recompute would start from the modified values. Start the "
                "checkpointed stretch after that operation, or make it out of place."
            )
        if options.debug:
            self.forward_ops = log.ops
        return output

    def _pack(self, t: torch.Tensor) -> Any:
        if (type(t) is not _Tensor or t._base is not None) and _is_parameter(t):
            return t  # alive anyway: nothing to drop, nothing to recompute
        if self.input_ids is not None and id(t) in self.input_ids:
            return (t, t._version)  # an input of the region, held anyway
        index = len(self.metas)
        check = self.options.determinism_check
        if check == "none":
            self.metas.append(None)
        else:
            self.metas.append((t.shape, t.dtype, t.device))
            if check == "values":
                self.prints.append(
                    None
                    if self.unfilled and not t.requires_grad
                    else _state.unseen(_fingerprint, t)
                )
        return index

    # ----------------------------------------------------------------- backward

    def _unpack(self, index: Any) -> torch.Tensor:
        if type(index) is not int:
            if type(index) is tuple:
                held, version = index
                if held._version != version:
                    raise self._modified_input(held, version)
                return held  # type: ignore[no-any-return]
            return index  # type: ignore[no-any-return]
        saved = self.recomputed
        if saved is None or index >= len(saved) or saved[index] is None:
            saved = self.recomputed = self._recompute()
        t = saved[index]
        saved[index] = None  # each saved tensor is unpacked once per recompute
        assert t is not None
        return t

    def _current_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.saver is None:
            assert self.inputs is not None and self.versions is not None
            now = _versions(self.inputs)
            if now != self.versions:
                raise self._modified_input(
                    *next(
                        (t, v)
                        for t, v, n in zip(self.inputs, self.versions, now)  # noqa: B905
                        if n != v
                    )
                )
            return self.args, self.kwargs
        assert self.saver.grad_fn is not None
        tensors = list(self.saver.grad_fn.saved_tensors)
        return replace_tensors(self.args, tensors), replace_tensors(
            self.kwargs, tensors[len(tensors_in(self.args)) :]
        )

    def _cache_copies(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        assert self.caches is not None
        changed = self.caches.changed()
        if changed is not None:
            raise CheckpointError(
                f"seqckpt: checkpointed {self._label()} was given a key/value cache "
                f"whose {changed} was written in place after the region started "
                "(a StaticCache, a recurrent state), so its recompute would not see "
                "the cache its forward saw. Pass use_cache=False in training (HF's "
                "own checkpointing turns the cache off), or leave this layer "
                "unchecked."
            )
        return self.caches.arguments(self.function, args, kwargs)

    def _label(self) -> str:
        return self.name or _name(self.function)

    def _modified_input(self, t: torch.Tensor, expected: int) -> CheckpointError:
        assert self.inputs is not None
        i = next(i for i, u in enumerate(self.inputs) if u is t)
        return CheckpointError(
            f"seqckpt: input tensor #{i} (shape {tuple(t.shape)}) of "
            f"checkpointed {self._label()} was modified in place "
            "after it was passed in, so backward would see other values (one of "
            "the variables needed for gradient computation has been modified by "
            "an inplace operation: it is at version "
            f"{t._version}; expected version {expected} instead). Pass a clone, or "
            "move the in-place operation after the backward."
        )

    def _recompute(self) -> list[torch.Tensor | None]:
        options = self.options
        grad_was_enabled = torch.is_grad_enabled()
        args, kwargs = self._current_inputs()
        function = self.function
        if self.caches is not None:
            function, args, kwargs = self._cache_copies(args, kwargs)
        if self.streams:
            _state.wait_for_streams(self.streams, self.inputs or ())
        collected: list[torch.Tensor | None] = []
        prints: list[torch.Tensor | None] = []
        fingerprint = options.determinism_check == "values"
        # Stop as soon as the last tensor the forward saved is back: what runs
        # after it (the region's last op when it saves only its inputs, a
        # trailing nested region) would be thrown away. "values" and
        # early_stop=False run to the end so that the count is checked exactly,
        # and so does a region whose op saves a tensor before filling it
        # (self.unfilled). A recompute asked for while the forward still runs
        # (a backward inside the function) always stops where the forward is now.
        run_to_end = not self.in_forward and (
            fingerprint or not options.early_stop or self.unfilled
        )
        unfilled = self.unfilled
        wanted = -1 if run_to_end else len(self.metas)
        stopped = False
        input_ids = self.input_ids

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal stopped
            if (
                (type(t) is not _Tensor or t._base is not None) and _is_parameter(t)
            ) or (input_ids is not None and id(t) in input_ids):
                return t  # held by the forward's graph, as in _pack
            detached = t.detach()
            if stopped:  # the function caught the stop and went on
                return detached
            # Tensors that do not require grad come back as the very object
            # saved (identity and Python attributes kept, as without hooks).
            # The others come back detached, also under create_graph: autograd
            # gives an unpacked tensor the forward's graph edge, never the
            # recompute's, and a recompute graph handed back with it kept the
            # region's inputs alive from second-order gradients on.
            collected.append(detached if t.requires_grad else t)
            if fingerprint:  # now: a saved buffer may change after the recompute
                prints.append(
                    None
                    if unfilled and not t.requires_grad
                    else _state.unseen(_fingerprint, detached)
                )
            if len(collected) == wanted:
                stopped = True
                raise _StopRecompute
            return detached

        extra: ExitStack | None = None
        kept = self.kept
        if self.recompute_context is not None or options.debug or kept is not None:
            extra = ExitStack()
            if self.recompute_context is not None:
                extra.enter_context(self.recompute_context)
            if kept is not None:
                # a recompute inside the forward leaves the cache to the real one
                replayed = self.rng.generator_keys() if self.rng is not None else ()
                extra.enter_context(
                    Serving(kept, consume=not self.in_forward, replayed=replayed)
                )
            if options.debug:
                log = extra.enter_context(_OpLog())
        caller_rng = self.rng.current() if self.rng is not None else None
        undo = ambient = None
        caller_modes: list[tuple[nn.Module, bool]] = []
        phase = _state.begin(_state.RECOMPUTING)
        try:
            modes = self.modes
            if modes is not None and list(map(_training, modes[0])) != modes[1]:
                caller_modes = _set_modes(*modes)
            undo = self.guard.replay() if self.guard is not None else None
            if self.rng is not None:
                self.rng.restore()
            ambient = self.ambient.replay()
            _set_grad_enabled(True)
            if _USER_HOOKS is not None:
                _mark_internal(pack)
            torch._C._autograd._push_saved_tensors_default_hooks(pack, _identity)
            remade: list[_Region] = []
            running = _POLICY_CHILDREN.set((remade, False))
            try:
                if extra is None:
                    function(*args, **kwargs)
                else:
                    with extra:
                        function(*args, **kwargs)
            except Exception:
                # Our stop arrives as _StopRecompute, or as a RuntimeError when
                # it crossed TorchScript; anything raised before it is the user's.
                if not stopped:
                    raise
            finally:
                _POLICY_CHILDREN.reset(running)
                torch._C._autograd._pop_saved_tensors_default_hooks()
                if _USER_HOOKS is not None:
                    del pack._user_hooks  # type: ignore[attr-defined]
            if self.children is not None and not self.in_forward:
                # The nested regions of the forward get what their remade
                # twins kept (a twin the early stop never reached leaves its
                # region to recompute in full).
                for ref, twin in zip(self.children, remade):  # noqa: B905
                    child = ref()
                    if child is not None and child.kept is None:
                        child.kept = twin.kept
        finally:
            _set_grad_enabled(grad_was_enabled)
            for module, mode in caller_modes:  # (the recompute may set some)
                module.training = mode
            if ambient is not None:
                _state.Ambient.undo(ambient)
            _state.end(_state.RECOMPUTING, phase)
            if caller_rng is not None:
                caller_rng.restore()
            if undo is not None:
                assert self.guard is not None
                self.guard.restore(undo)
        if kept is not None and not self.in_forward:
            self.kept = None  # served: the recomputed saved tensors hold what is needed
        self._verify(collected, prints, log.ops if options.debug else None)
        return collected

    def _verify(
        self,
        collected: list[torch.Tensor | None],
        prints: list[torch.Tensor | None],
        recompute_ops: list[str] | None,
    ) -> None:
        check = self.options.determinism_check
        count_ok = len(collected) == len(self.metas)
        metas_ok = check == "none" or (
            count_ok and [(t.shape, t.dtype, t.device) for t in collected] == self.metas  # type: ignore[union-attr]
        )
        bad = None
        if check == "values" and count_ok and metas_ok:
            bad = _first_mismatch(self.prints, prints)
        if count_ok and metas_ok and bad is None:
            return
        name = self._label()
        debug = ""
        if recompute_ops is not None and self.forward_ops is not None:
            debug = _op_difference(self.forward_ops, recompute_ops)
        # Each message also carries the words of torch's own error for the
        # case, so code and tests written against torch's checkpoint match it.
        if not count_ok:
            what = (
                "was trying to save more tensors during recomputation than during "
                "the original forward pass"
                if len(collected) > len(self.metas)
                else "A different number of tensors was saved during the original "
                "forward and recomputation"
            )
            raise CheckpointError(
                f"seqckpt: checkpointed {name}: {what}: the recompute "
                f"saved {len(collected)} tensors for backward, but its forward saved "
                f"{len(self.metas)}. The function must do the same work twice: make "
                "any state it branches on (flags, Python randomness, data-dependent "
                "control flow) the same in backward, or do not checkpoint it "
                "(debug=True names the first op that differs)." + debug
            )
        for i, (t, meta) in enumerate(zip(collected, self.metas, strict=True)):
            assert t is not None
            now = (t.shape, t.dtype, t.device)
            if now != meta:
                raise CheckpointError(
                    f"seqckpt: saved tensor #{i} of checkpointed {name} differs "
                    f"between forward ({_describe(meta)}) and recompute "
                    f"({_describe(now)}). Recomputed values for the following "
                    "tensors have different metadata than during the forward "
                    f"pass: #{i}. The function must compute the same thing twice; "
                    "check global state it reads." + debug
                )
        assert bad is not None
        before, after = self.prints[bad], prints[bad]
        assert before is not None and after is not None
        raise CheckpointError(
            f"seqckpt: saved tensor #{bad} of checkpointed {name} "
            f"({_describe(self.metas[bad])}) has other values in the "
            "recompute than in forward (fingerprints "
            f"{before.tolist()} vs {after.tolist()}). Something "
            "nondeterministic runs inside: RNG outside torch, a "
            "torch.Generator of your own that the region reaches through a "
            "global (the default generators and those its modules hold, it is "
            "given or closes over are replayed), nondeterministic kernels, or "
            "state changed between the runs." + debug
        )


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors``; -1 for an inference tensor, which
    has none (and cannot be changed in place outside inference mode)."""
    try:
        return list(map(_version, tensors))
    except RuntimeError:
        return [-1 if t.is_inference() else t._version for t in tensors]


_training = operator.attrgetter("training")
_version = operator.attrgetter("_version")


def _set_modes(
    modules: list[nn.Module], modes: list[bool]
) -> list[tuple[nn.Module, bool]]:
    """Give each of ``modules`` the training flag in ``modes`` again; returns
    the flags it changed, as they were (each once: a shared module is listed as
    often as it was reached)."""
    changed = {
        id(m): (m, m.training)
        for m, mode in zip(modules, modes, strict=True)
        if m.training != mode
    }
    for module, mode in changed.values():
        module.training = not mode
    return list(changed.values())


def _two_contexts(
    context_fn: ContextFn,
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    contexts = context_fn()
    if not (isinstance(contexts, tuple | list) and len(contexts) == 2):
        raise TypeError(
            f"seqckpt: context_fn must return two context managers (one around "
            f"the forward, one around each recompute), as torch's takes it; "
            f"{_name(context_fn)} returned {contexts!r}. For one context in both "
            "passes, return (ctx(), ctx())."
        )
    return contexts[0], contexts[1]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# torch 2.14 and later: the user's saved-tensor hooks (save_on_cpu) as torch's
# selective checkpointing finds them, looking past the hooks of checkpoints.
_USER_HOOKS: Callable[[], Any] | None = getattr(
    _torch_checkpoint, "_current_user_saved_tensors_hooks", None
)


def _mark_internal(pack: Any) -> Any:
    """Mark a region's pack hook as a checkpoint's own, as torch marks its
    own, while it is pushed: torch's selective checkpointing inside the region
    then looks past it to the user's hooks (it took seqckpt's for the user's,
    warned on every call and, told to respect them, sent its kept tensors into
    the region's recompute). Taken off again after the pop (a graph keeps the
    hook in a way the garbage collector cannot see)."""
    assert _USER_HOOKS is not None
    pack._checkpoint_internal = True
    pack._user_hooks = _USER_HOOKS()
    return pack


# torch's selective-checkpointing forward mode (torch 2.14 and later read its
# respect_saved_tensors_hooks attribute; earlier ones ignore it)
_TORCH_SAC_CACHE: Any = getattr(_torch_checkpoint, "_CachingTorchDispatchMode", ())

_FUNCTORCH = torch._C._functorch
_peek_transform: Callable[[], Any] = getattr(
    _FUNCTORCH, "peek_interpreter_stack", lambda: None
)
_FORWARD_TRANSFORMS = {
    getattr(_FUNCTORCH.TransformType, name): label
    for name, label in (("Vmap", "torch.vmap"), ("Jvp", "torch.func.jvp"))
}


def _forward_transform() -> str | None:
    """``torch.vmap`` or ``torch.func.jvp`` (also as parts of ``jacfwd`` and
    ``hessian``) where one of them is active, else None."""
    for interpreter in _FUNCTORCH.get_interpreter_stack() or ():
        label = _FORWARD_TRANSFORMS.get(interpreter.key())
        if label is not None:
            return label
    return None


def _needs_grad(
    function: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modules: Iterable[nn.Module] | None,
) -> bool:
    """Whether an input, or a parameter of a module ``function`` visibly
    runs, requires grad (else there is nothing a checkpoint could save); a
    tensor batched by vmap or made dual by jvp says False, the tensor it
    wraps tells."""
    runs = modules_of(function, None, args, kwargs) if modules is None else modules
    tensors = [*tensors_in((args, kwargs)), *(p for m in runs for p in m.parameters())]
    return any(_unwrapped(t).requires_grad for t in tensors)


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        t = _FUNCTORCH.get_unwrapped(t)
    return t


_set_grad_enabled = torch._C._set_grad_enabled
_hooks_enabled: Callable[[], bool] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True
)


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()`` saved by a linear layer):
    kept alive by its module, so a region holds it instead of recomputing it.
    (A plain tensor that is not a view is neither: the pack hooks tell so
    without calling this.)"""
    if is_parameter(t):
        return True
    base = t._base
    return base is not None and is_parameter(base)
