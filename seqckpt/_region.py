"""One checkpointed call, :class:`_Region`: its first run and its recompute.

How it works. The function runs once in forward with autograd on, so the real
graph is built, but under saved-tensor hooks that replace every tensor autograd
wants to keep by its index (in a holder the region refers to weakly). When
backward first needs one of them, the region is run again (same RNG, autocast,
default device, backend switches, buffers and module training modes as the
first time) and every tensor it saves is collected by index, except those
whose holder is gone (the node that saved it was freed unused, as when a
result computed with grad is detached); each node then gets back the tensor it
saved the first time (the very object, for tensors that do not require grad).
The graph that backward walks is the one built in forward, so
``torch.autograd.grad``, ``backward(inputs=...)``, parameters that are not
inputs, double backward, ``retain_graph`` and a backward run *inside* the
function behave as without checkpointing, and gradients are bitwise those of
the plain run.

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
import functools
import operator
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any

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
    watching_modules,
)
from seqckpt._caches import CacheCopies
from seqckpt._fingerprint import fingerprint, first_mismatch
from seqckpt._options import CheckpointError, ContextFn, Options
from seqckpt._tree import copy_lists, replace_tensors, tensors_in
from seqckpt.policies import Keeping, Kept, Serving, uncounted_op

if TYPE_CHECKING:
    from seqckpt.keep import KeptCalls


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


_DEBUG_HEAD = (
    "\nseqckpt debug: You are seeing this error because you passed "
    "`debug=True` to checkpoint (or torch's set_checkpoint_debug_enabled(True) "
    "is on). "
)


def _op_difference(forward: list[str], recompute: list[str]) -> str:
    if forward == recompute:
        return _DEBUG_HEAD + (
            f"The forward and the recompute ran the same {len(forward)} ops, so "
            "the difference is in what they computed, not in which ops ran."
        )
    at = next(
        (i for i, (a, b) in enumerate(zip(forward, recompute, strict=False)) if a != b),
        min(len(forward), len(recompute)),
    )
    window = slice(max(0, at - 3), at + 3)
    return _DEBUG_HEAD + (
        f"The forward ran {len(forward)} ops, the recompute "
        f"{len(recompute)}; they first differ at op #{at}.\n"
        f"  forward   ops #{window.start}..: {', '.join(forward[window]) or '-'}\n"
        f"  recompute ops #{window.start}..: {', '.join(recompute[window]) or '-'}"
    )


_EMPTY = torch.empty(0)


# The region whose function runs now (innermost), the list where a region
# with a policy that is created during this pass registers, and whether the
# pass is the region's first forward. A nested region's recompute runs after
# its parent's; what it keeps in the parent's first forward would be held all
# that time, so it keeps nothing then, and the parent's recompute, which makes
# the region again, hands the new one's kept outputs to it. seqckpt.keep finds
# its region here.
RUNNING: contextvars.ContextVar[tuple[_Region, list[_Region], bool] | None] = (
    contextvars.ContextVar("seqckpt_running_region", default=None)
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
        "holders",
        "params",
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
        "pack_now",
        "kept_calls",
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
        self.holders: list[weakref.ref[_Saved]] = []
        # the parameters (or views of them) its forward saved, held as they are
        self.params: list[torch.Tensor] = []
        self.prints: list[torch.Tensor | None] = []
        self.recomputed: list[torch.Tensor | _Gone | None] | None = None
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
        # the pack hook of the pass running now, and the calls seqckpt.keep
        # kept in the forward (see seqckpt.keep)
        self.pack_now: Callable[[torch.Tensor], Any] | None = None
        self.kept_calls: KeptCalls | None = None
        if options.policy is not None:
            running = RUNNING.get()
            if running is not None:
                running[1].append(self)
                self.keep_later = running[2]
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
        running = RUNNING.set((self, children, True))
        pack: Callable[[torch.Tensor], Any] = self._pack
        if _USER_HOOKS is not None:
            pack = _mark_internal(functools.partial(_Region._pack, self))
        self.pack_now = pack
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
            RUNNING.reset(running)
            self.pack_now = None
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
            # Alive anyway: nothing to drop, nothing to recompute. Outside
            # other regions its version is checked in backward, as autograd
            # checks what it saves itself (an optimizer step before backward).
            self.params.append(t)
            return t if self.input_ids is None else (t, t._version)
        if self.input_ids is not None and id(t) in self.input_ids:
            return (t, t._version)  # an input of the region, held anyway
        holder = _Saved(len(self.metas))
        self.holders.append(_weak(holder))
        check = self.options.determinism_check
        if check == "none":
            self.metas.append(None)
        else:
            self.metas.append((t.shape, t.dtype, t.device))
            if check == "values":
                self.prints.append(
                    None
                    if self.unfilled and not t.requires_grad
                    else _state.unseen(fingerprint, t)
                )
        return holder

    # ----------------------------------------------------------------- backward

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not _Saved:
            if type(packed) is tuple:
                held, version = packed
                if held._version != version:
                    raise self._modified_input(held, version)
                return held  # type: ignore[no-any-return]
            return packed  # type: ignore[no-any-return]
        index = packed.index
        saved = self.recomputed
        if saved is None or index >= len(saved) or saved[index] is None:
            saved = self.recomputed = self._recompute()
        t = saved[index]
        saved[index] = None  # each saved tensor is unpacked once per recompute
        assert isinstance(t, torch.Tensor)
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

    def _modified_parameter(self, t: torch.Tensor, expected: int) -> CheckpointError:
        return CheckpointError(
            f"seqckpt: a parameter (shape {tuple(t.shape)}) that checkpointed "
            f"{self._label()} saved for backward was modified in place after its "
            "forward (an optimizer step before this backward?), as the plain run "
            "would report too: one of the variables needed for gradient "
            "computation has been modified by an inplace operation: it is at "
            f"version {t._version}; expected version {expected} instead. Run the "
            "backward before the step, or run the forward again after it."
        )

    def _modified_input(self, t: torch.Tensor, expected: int) -> CheckpointError:
        """The error for a held tensor written in place since the forward: an
        input, else a parameter (see ``_pack``)."""
        assert self.inputs is not None
        i = next((i for i, u in enumerate(self.inputs) if u is t), None)
        if i is None:
            return self._modified_parameter(t, expected)
        return CheckpointError(
            f"seqckpt: input tensor #{i} (shape {tuple(t.shape)}) of "
            f"checkpointed {self._label()} was modified in place "
            "after it was passed in, so backward would see other values (one of "
            "the variables needed for gradient computation has been modified by "
            "an inplace operation: it is at version "
            f"{t._version}; expected version {expected} instead). Pass a clone, or "
            "move the in-place operation after the backward."
        )

    def _recompute(self) -> list[torch.Tensor | _Gone | None]:
        options = self.options
        grad_was_enabled = torch.is_grad_enabled()
        args, kwargs = self._current_inputs()
        function = self.function
        if self.caches is not None:
            function, args, kwargs = self._cache_copies(args, kwargs)
        if self.streams:
            _state.wait_for_streams(self.streams, self.inputs or ())
        collected: list[torch.Tensor | _Gone | None] = []
        prints: list[torch.Tensor | None] = []
        fingerprinting = options.determinism_check == "values"
        # Stop as soon as the last tensor the forward saved is back: what runs
        # after it (the region's last op when it saves only its inputs, a
        # trailing nested region) would be thrown away. "values" and
        # early_stop=False run to the end so that the count is checked exactly,
        # and so does a region whose op saves a tensor before filling it
        # (self.unfilled). A recompute asked for while the forward still runs
        # (a backward inside the function) always stops where the forward is now.
        run_to_end = not self.in_forward and (
            fingerprinting or not options.early_stop or self.unfilled
        )
        unfilled = self.unfilled
        wanted = -1 if run_to_end else len(self.metas)
        stopped = False
        input_ids = self.input_ids
        holders = self.holders
        known = len(holders)
        params = self.params
        param_versions = _versions(params) if params else None

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal stopped
            if (
                (type(t) is not _Tensor or t._base is not None) and _is_parameter(t)
            ) or (input_ids is not None and id(t) in input_ids):
                return t  # held by the forward's graph, as in _pack
            detached = t.detach()
            if stopped:  # the function caught the stop and went on
                return detached
            n = len(collected)
            if n < known and holders[n]() is None:
                # No node will ask for it: the graph that saved it in forward
                # was freed before backward (a result computed with grad, then
                # detached). Only its description is kept, for the check.
                collected.append(_Gone(t))
            else:
                # Tensors that do not require grad come back as the very object
                # saved (identity and Python attributes kept, as without
                # hooks). The others come back detached, also under
                # create_graph: autograd gives an unpacked tensor the forward's
                # graph edge, never the recompute's, and a recompute graph
                # handed back with it kept the region's inputs alive from
                # second-order gradients on.
                collected.append(detached if t.requires_grad else t)
            if fingerprinting:  # now: a saved buffer may change after the recompute
                prints.append(
                    None
                    if unfilled and not t.requires_grad
                    else _state.unseen(fingerprint, detached)
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
            running = RUNNING.set((self, remade, False))
            forward_pack, self.pack_now = self.pack_now, pack
            if self.kept_calls is not None:
                self.kept_calls.served = 0
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
                RUNNING.reset(running)
                self.pack_now = forward_pack
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
            if param_versions is not None:
                _undo_version_moves(params, param_versions, _versions(params))
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
        collected: list[torch.Tensor | _Gone | None],
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
            bad = first_mismatch(self.prints, prints)
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
        cause = (
            "Something"
            if self.options.preserve_rng_state
            else "It runs with preserve_rng_state=False, so its random ops "
            "(dropout) draw other numbers in the recompute: leave "
            "preserve_rng_state at True. If it draws none, something"
        )
        raise CheckpointError(
            f"seqckpt: saved tensor #{bad} of checkpointed {name} "
            f"({_describe(self.metas[bad])}) has other values in the "
            "recompute than in forward (fingerprints "
            f"{before.tolist()} vs {after.tolist()}). {cause} "
            "nondeterministic runs inside: RNG outside torch, a "
            "torch.Generator of your own that the region reaches through a "
            "global object's attribute (the default generators and those its "
            "modules hold, it is given, closes over or names as a global are "
            "replayed), nondeterministic kernels, or "
            "state changed between the runs (a parameter an optimizer stepped "
            "between forward and backward)." + debug
        )


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors``; -1 for an inference tensor, which
    has none (and cannot be changed in place outside inference mode)."""
    try:
        return list(map(_version, tensors))
    except RuntimeError:
        return [-1 if t.is_inference() else t._version for t in tensors]


def _undo_version_moves(
    tensors: list[torch.Tensor], versions: list[int], now: list[int]
) -> None:
    """Put back the version counters of ``tensors`` that a recompute moved
    from ``versions`` to ``now`` by writing into them (a max-norm clamp of a
    weight in forward): the plain run wrote once, so what autograd saved
    before must still count as unchanged, and only writes from outside a
    recompute (an optimizer step) are reported."""
    if now == versions:
        return
    moved = [i for i, (a, b) in enumerate(zip(now, versions, strict=True)) if a != b]
    torch._C._autograd._unsafe_set_version_counter(
        tuple(tensors[i] for i in moved), tuple(versions[i] for i in moved)
    )


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


class _Saved:
    """What autograd holds for a tensor that a region recomputes: its index
    among the tensors the region saved. The region refers to it weakly: once
    autograd lets it go (the node that saved the tensor was freed unused, as
    when a result computed with grad is detached), the recompute does not keep
    that tensor (torch's checkpoint drops it too)."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index


_weak = weakref.ref


class _Gone:
    """Stands in the recompute's list for a saved tensor no node will ask for
    (see :class:`_Saved`): its description, for the determinism check."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device


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


_set_grad_enabled = torch._C._set_grad_enabled


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()`` saved by a linear layer):
    kept alive by its module, so a region holds it instead of recomputing it.
    (A plain tensor that is not a view is neither: the pack hooks tell so
    without calling this.)"""
    if is_parameter(t):
        return True
    base = t._base
    return base is not None and is_parameter(base)
