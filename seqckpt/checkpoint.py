"""The recompute primitive: :func:`checkpoint`, its decorator form
:class:`CheckpointedFunction`, and :func:`run_region`, which sends each call to
a region (:mod:`seqckpt._region`, whose docstring tells how the recompute
works), to a plain run where checkpointing cannot help or cannot work (no
grad, saved-tensor hooks switched off, under ``vmap`` or ``jvp``, a lazy
module's first call), or to torch's checkpoint in code that ``torch.compile``
traces.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, overload

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn

from seqckpt import _state
from seqckpt._buffers import modules_of, survey
from seqckpt._options import (
    DEFAULT_OPTIONS,
    CheckpointError,
    ContextFn,
    DeterminismCheck,
    Options,
    make_options,
    with_torch_switches,
)
from seqckpt._region import _compiled_part, _name, _Region
from seqckpt._state import _GENERATOR
from seqckpt._tree import tensors_in

__all__ = ["CheckpointError", "CheckpointedFunction", "checkpoint"]

# torch's own functions, as they were when seqckpt was imported: compiled code
# goes to torch's checkpoint even while seqckpt.replace_torch_checkpoint() has
# put seqckpt's in its place.
TORCH_CHECKPOINT: Callable[..., Any] = _torch_checkpoint.checkpoint
TORCH_CHECKPOINT_SEQUENTIAL: Callable[..., Any] = (
    _torch_checkpoint.checkpoint_sequential
)


T = TypeVar("T")


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
        if _state.is_exporting():
            # torch.export records the plain forward (what torch's checkpoint
            # gives under non-strict export; under strict export torch 2.13's
            # checkpoint operator fails, a KeyError on '_checkpoint_context_fn')
            return function(*args, **kwargs)
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
    options = with_torch_switches(options)
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


_hooks_enabled: Callable[[], bool] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True
)
