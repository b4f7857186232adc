"""Calls a checkpointed region keeps whole: :func:`keep`.

A region keeps its inputs and recomputes everything else; a policy keeps the
outputs of chosen ops, picked one by one by a dispatch mode that sees every op.
``keep`` says it for a stretch of code instead: inside a region's function,
``seqckpt.keep(self.attention, x)`` runs the attention with the region's
saved-tensor hooks lifted, so what its ops save for backward is held as
without checkpointing, and remembers its output. The recompute does not run it
again: it is handed that output (and the RNG state the call left behind) and
goes on from there. No dispatch mode is involved, so the call costs nothing
per op, and code the policy forms cannot name (custom kernels, an autograd
Function, one matmul of two) is kept as easily as a module.

How it stays exact. Calls are matched by their order within the region: the
recompute's ``n``-th ``keep`` is served the forward's ``n``-th output when it
calls the same function, that output was not written in place since
(``out += residual`` after the call) and the call wrote into none of the
tensors it was given; otherwise it runs the call again, with
the hooks still lifted, so the count of saved tensors the recompute collects
never depends on which calls were served. seqckpt's own dispatch modes (a
policy's, ``debug``'s op log) are set aside during the call in both passes, so
the ops a policy numbers are the same ones whether or not it is served. Under
torch's selective checkpointing (``context_fn``), which numbers ops the same
way and cannot be set aside, the call is kept but always run again.
"""

from __future__ import annotations

import contextvars
import functools
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)

from seqckpt._region import RUNNING, _is_parameter, _name, _OpLog, _versions
from seqckpt._state import wait_for_streams
from seqckpt._tree import replace_tensors, tensors_in
from seqckpt.blocks import without_own_forward
from seqckpt.policies import Keeping, Serving

if TYPE_CHECKING:
    from seqckpt._region import _Region
    from seqckpt._state import RngState

__all__ = ["KeptForward", "keep", "keep_modules"]

T = TypeVar("T")

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks


def keep(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``function(*args, **kwargs)`` inside a checkpointed function,
    keeping what it saves for backward: the region's recompute does not run it
    again but takes its output as the forward made it.

    Use it on the expensive part of a checkpointed block (attention, a large
    projection, a custom kernel) to trade memory for recompute time by a
    stretch of code rather than by op. Memory: what the call saves for
    backward, plus its outputs, are held until backward has passed the
    region. Outside a seqckpt region (and under ``torch.compile``, where a
    region becomes torch's checkpoint operator) it is a plain call.

    Gradients, outputs and buffers stay bitwise those of the plain run: the
    RNG state the call leaves behind is put in place when it is skipped (the
    region's ``preserve_rng_state``), module buffers it updates are updated
    once, and a call whose output was written in place after it, one that
    wrote into a tensor it was given (an in-place activation), or a recompute
    that makes another call in its place, runs the call again. What a skipped
    call writes elsewhere (a module buffer) is not written again in the
    recompute: right for batch-norm statistics, which training does not read,
    but keep a call out of ``keep`` if later code in the region reads state
    it writes.

    Args:
        function: any callable: a module, a function, a bound method.
        *args: its positional arguments.
        **kwargs: its keyword arguments (all of them passed on).

    Returns:
        What ``function`` returns.

    Example:
        >>> import torch, seqckpt
        >>> attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
        ...                           torch.nn.Linear(32, 8))
        >>> def block(x):
        ...     a, _ = seqckpt.keep(attention, x, x, x, need_weights=False)
        ...     h = x + a
        ...     return h + mlp(h)  # recomputed in backward; the attention is not
        >>> x = torch.randn(2, 5, 8, requires_grad=True)
        >>> seqckpt.checkpoint(block, x).sum().backward()
    """
    if not callable(function):
        raise TypeError(
            "seqckpt: keep() takes the callable to keep first, got "
            f"{function!r} of type {type(function).__name__}; call it as "
            "seqckpt.keep(module, x), not seqckpt.keep(module(x))."
        )
    if torch.compiler.is_compiling():
        return function(*args, **kwargs)
    running = RUNNING.get()
    if running is None:
        noted = REPORTING.get()
        if noted is None:
            return function(*args, **kwargs)
        # seqckpt.what_is_kept runs the function as a region's forward: the
        # call is kept whole there, so its ops are not the policy's to keep
        noted.append(_label(function))
        with _own_modes_lifted():
            return function(*args, **kwargs)
    region, _, first = running
    calls = region.kept_calls
    if first:
        if calls is None:
            calls = region.kept_calls = KeptCalls()
        return calls.record(region, function, args, kwargs)
    if calls is None:  # (the forward made no such call)
        return _run_lifted(region, function, args, kwargs)
    return calls.serve(region, function, args, kwargs)


# While seqckpt.what_is_kept runs a function: the calls kept whole, by name.
REPORTING: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "seqckpt_kept_calls_reported", default=None
)


def _label(function: Callable[..., Any]) -> str:
    """What a report calls a kept call: as errors call a region's function,
    with the method's name where it is not a module's forward."""
    method = getattr(function, "__name__", "forward")
    if (
        isinstance(getattr(function, "__self__", None), nn.Module)
        and method != "forward"
    ):
        return f"{_name(function)}.{method}"
    return _name(function)


class KeptCalls:
    """The outputs of the calls a region's forward kept, in order, with what
    a recompute needs to stand them in for the call; ``served``: how many the
    recompute running now has reached."""

    __slots__ = ("entries", "served")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.served = 0

    def record(
        self,
        region: _Region,
        function: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        given = tensors_in(args)
        if kwargs:
            tensors_in(kwargs, given)
        before = _versions(given)
        out = _run_lifted(region, function, args, kwargs)
        if region.options.context_fn is not None or _versions(given) != before:
            # torch's selective checkpointing numbers the call's ops in both
            # passes; a call that wrote into a tensor it was given (an in-place
            # activation) must write it in the recompute too: both run again
            self.entries.append(None)
            return out
        tensors = tensors_in(out)
        held: list[torch.Tensor] = []
        serve_as: list[bool | None] = []
        inputs = region.input_ids
        for t in tensors:
            if _is_parameter(t) or (inputs is not None and id(t) in inputs):
                # what the region holds anyway, and its hooks tell by identity
                # (a call that returns its input): served as the very object
                held.append(t)
                serve_as.append(None)
            else:
                # detached: the region must not hold the forward's graph (a
                # cycle through autograd's nodes the garbage collector cannot see)
                held.append(t.detach())
                serve_as.append(t.requires_grad)
        self.entries.append(
            (
                _identity(function),
                replace_tensors(out, held),
                _versions(held),
                serve_as,
                region.rng.current() if region.rng is not None else None,
            )
        )
        return out

    def serve(
        self,
        region: _Region,
        function: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        index = self.served
        self.served = index + 1
        entry = self.entries[index] if index < len(self.entries) else None
        if entry is not None:
            identity, out, versions, serve_as, rng = entry
            held = tensors_in(out)
            if identity == _identity(function) and versions == _versions(held):
                if region.streams:  # made on the forward's stream, used here
                    wait_for_streams(region.streams, held)
                if rng is not None:
                    rng.restore()
                # fresh leaves: the recompute's graph is thrown away, and ops
                # save for backward only what a tensor requiring grad needs
                served: T = replace_tensors(
                    out,
                    [
                        t if grad is None else t.detach().requires_grad_(grad)
                        for t, grad in zip(held, serve_as, strict=True)
                    ],
                )
                return served
        return _run_lifted(region, function, args, kwargs)


# (what identifies the function, its output with its tensors detached or, for
# one served as the very object, as they are, their versions, per tensor
# whether it required grad or None for the very object, the RNG state after
# the call), or None for a call that always runs again
_Entry = tuple[Any, Any, list[int], list[bool | None], "RngState | None"] | None


def _identity(function: Callable[..., Any]) -> Any:
    """What tells one kept call's function from another's across the two
    passes: a bound method, a partial, a lambda or a nested function is made
    anew on each call (a function by its code, what it closes over being the
    replay's own)."""
    if isinstance(function, functools.partial):
        return (_identity(function.func), len(function.args), tuple(function.keywords))
    owner = getattr(function, "__self__", None)
    if owner is not None and hasattr(function, "__func__"):
        return (function.__func__, id(owner))  # type: ignore[attr-defined]
    if isinstance(function, types.FunctionType):
        return function.__code__
    return function


def _run_lifted(
    region: _Region,
    function: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    """``function`` called with the region's saved-tensor hooks and seqckpt's
    own dispatch modes lifted, as if outside the region (regions made inside
    it are regions of their own)."""
    with _hooks_lifted(region), _own_modes_lifted():
        token = RUNNING.set(None)
        try:
            return function(*args, **kwargs)
        finally:
            RUNNING.reset(token)


@contextmanager
def _hooks_lifted(region: _Region) -> Iterator[None]:
    top = _top_hooks(False)
    if top is None or top[0] is not region.pack_now:
        # hooks of the user's inside the region are on top: the call runs
        # under them, and the region's do not see it
        yield
        return
    _pop_hooks()
    try:
        yield
    finally:
        _push_hooks(*top)


@contextmanager
def _own_modes_lifted() -> Iterator[None]:
    with ExitStack() as lifted:
        while isinstance(_get_current_dispatch_mode(), (Keeping, Serving, _OpLog)):
            lifted.enter_context(_pop_mode_temporarily())
        yield


class KeptForward:
    """A module's forward run through :func:`keep`: set as the module's
    ``forward`` (:func:`keep_modules` does it), so every call of the module
    inside a seqckpt region is kept whole there, and a plain call elsewhere.
    The module keeps its place, name and ``state_dict`` keys; its hooks run
    around the kept call (in a recompute too, as every module's do). Prefer
    :func:`keep_modules`, which also gives DataParallel replicas their own
    and lets ``torch.jit.script`` compile the module's forward.

    Example:
        >>> import torch, seqckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        >>> block[0].forward = seqckpt.KeptForward(block[0])
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> seqckpt.checkpoint(block, x).sum().backward()  # the Linear not recomputed
    """

    __slots__ = ("module", "forward")

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                "seqckpt: KeptForward takes the nn.Module whose forward it "
                f"replaces, got {type(module).__name__}."
            )
        self.module = module
        own = module.__dict__.get("forward")  # (one set on the module already)
        self.forward = None if isinstance(own, KeptForward) else own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.forward or type(module).forward.__get__(module)
        return keep(forward, *args, **kwargs)

    def __repr__(self) -> str:
        return f"KeptForward({type(self.module).__name__})"


def keep_modules(model: nn.Module, *names: str | type[nn.Module]) -> list[str]:
    """Make every submodule of ``model`` with one of ``names`` (or of one of
    the classes given) run through :func:`keep`, in place: inside a seqckpt
    region (however the region is made: ``seqckpt.checkpoint``, HF's switch
    given seqckpt's function, :func:`~seqckpt.checkpoint_blocks`,
    ``replace_torch_checkpoint``) what it saves is kept and the recompute does
    not run it again; elsewhere it runs as before. This is how to keep, say,
    every attention of a model whose code you do not want to edit.

    A name matches a submodule whose qualified name is it or ends with it
    after a dot: ``"self_attn"`` matches ``model.layers.0.self_attn`` in every
    layer, ``"mlp.down_proj"`` each MLP's output projection. A class matches
    its instances (``LlamaAttention``, whatever the attribute is called).

    Args:
        model: any module.
        *names: one or more names (or dotted ends of names) of submodules, or
            ``nn.Module`` subclasses.

    Returns:
        The qualified names of the submodules now kept, in ``model``'s order.

    Raises:
        ValueError: nothing given, or a name or class that matches no
            submodule (the message lists what the model's submodules are
            called).

    Example:
        >>> import torch, seqckpt
        >>> layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        >>> seqckpt.keep_modules(layer, "self_attn")
        ['self_attn']
        >>> seqckpt.keep_modules(layer, torch.nn.Dropout)
        ['dropout', 'dropout1', 'dropout2']
        >>> x = torch.randn(2, 5, 16, requires_grad=True)
        >>> seqckpt.checkpoint(layer, x).sum().backward()  # attention not recomputed
    """
    if not names:
        raise ValueError(
            "seqckpt: keep_modules() needs at least one submodule name or class, "
            'e.g. seqckpt.keep_modules(model, "self_attn").'
        )
    for name in names:
        if not (
            isinstance(name, str)
            or (isinstance(name, type) and issubclass(name, nn.Module))
        ):
            raise TypeError(
                "seqckpt: keep_modules() takes submodule names and nn.Module "
                f"classes, got {name!r} of type {type(name).__name__}."
            )
    found: list[str] = []
    matched: set[str | type[nn.Module]] = set()
    for qualified, module in model.named_modules():
        if not qualified:  # (the model itself)
            continue
        hits = [n for n in names if _matches(n, qualified, module)]
        if hits:
            matched.update(hits)
            if not isinstance(module.__dict__.get("forward"), KeptForward):
                _give_kept_forward(module)
            found.append(qualified)
    missing = [n for n in names if n not in matched]
    if missing:
        what, listed = (
            (
                f"named {missing[0]!r}",
                {q.rsplit(".", 1)[-1] for q, _ in model.named_modules()},
            )
            if isinstance(missing[0], str)
            else (
                f"of class {missing[0].__name__}",
                {type(m).__name__ for m in model.modules()},
            )
        )
        ends = sorted(listed - {""})
        shown = ", ".join(ends[:20]) + (", ..." if len(ends) > 20 else "")
        raise ValueError(
            f"seqckpt: keep_modules() found no submodule {what} in "
            f"{type(model).__name__}; its submodules are called: {shown}. "
            "Give a name (or the dotted end of one) from model.named_modules(), "
            "or a class of one of them."
        )
    return found


def _matches(name: str | type[nn.Module], qualified: str, module: nn.Module) -> bool:
    if isinstance(name, str):
        return qualified == name or qualified.endswith("." + name)
    return isinstance(module, name)


def _give_kept_forward(module: nn.Module) -> None:
    module.forward = KeptForward(module)  # type: ignore[method-assign]
    if isinstance(module, torch.jit.ScriptModule):
        return  # compiled already; TorchScript replicates it its own way
    # torch.jit.script asks this first: it compiles the module's own forward
    # (seqckpt.keep has no meaning in TorchScript) and the keep is taken off
    module.__prepare_scriptable__ = functools.partial(  # type: ignore[assignment]
        without_own_forward, module
    )
    # DataParallel's replicas copy the module's attributes: each must get a
    # forward that runs the replica, not the module
    module._replicate_for_data_parallel = functools.partial(  # type: ignore[method-assign]
        _replicate, module
    )


def _replicate(module: nn.Module) -> nn.Module:
    """``module``'s replica for ``nn.DataParallel``, kept like it."""
    replica: nn.Module = nn.Module._replicate_for_data_parallel(module)  # type: ignore[no-untyped-call]
    _give_kept_forward(replica)
    return replica
