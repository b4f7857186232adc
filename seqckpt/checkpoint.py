"""The recompute primitive: :func:`checkpoint` and its error type.

How it works. The function runs once in forward with autograd on, so the real
graph is built, but under saved-tensor hooks that replace every tensor autograd
wants to keep by its index. When backward first needs one of them, the region is
run again (same RNG, autocast, default device and buffers as the first time) and
every tensor it saves is collected by index; each node then gets back exactly the
tensor it saved the first time. The graph that backward walks is the one built in
forward, so ``torch.autograd.grad``, ``backward(inputs=...)``, parameters that are
not inputs, double backward and ``retain_graph`` behave as without checkpointing,
and gradients are bitwise those of the plain run.

The recompute stops as soon as the last of those tensors is back (an exception
raised in the saved-tensor hook, recognised also after TorchScript turned it
into a RuntimeError): the rest of the region would only produce an output that
is thrown away. That skips the region's last op when it saves only its inputs
(a Linear, GELU) and, in nested plans, a trailing inner region.

Differences from ``torch.utils.checkpoint(use_reentrant=False)``: TorchScript
runs unoptimised in the region so both runs save the same tensors (and the stop
works across it), module buffers (BatchNorm statistics) are updated once, and
the bookkeeping per region is a few attribute writes, which is what makes small
regions cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from seqckpt import _state
from seqckpt._tree import replace_tensors, tensors_in

__all__ = ["CheckpointError", "checkpoint"]

DeterminismCheck = Literal["default", "values", "none"]
_CHECKS = ("default", "values", "none")

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """Raised when a recompute does not reproduce what its forward saved, or when
    the inputs of a checkpointed region were modified in place before backward."""


def checkpoint(
    function: Callable[..., T],
    *args: Any,
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = "default",
    **kwargs: Any,
) -> T:
    """Call ``function(*args, **kwargs)`` without keeping its activations.

    The tensors autograd would keep for backward are dropped during forward and
    recomputed, by running ``function`` again, when backward needs them. Only the
    inputs are held. Gradients, outputs and module buffers are bitwise those of
    the plain call on CPU.

    Args:
        function: any callable: an ``nn.Module``, a TorchScript module, a function.
        *args: positional arguments; tensors may sit in nested tuples, lists and
            dicts, and need not require grad (parameters used by ``function``
            still get their gradients).
        preserve_rng_state: replay the CPU and accelerator RNG of the first run in
            the recompute, so dropout draws the same mask. The caller's RNG after
            backward is what the plain run leaves.
        determinism_check: ``"default"`` raises :class:`CheckpointError` when the
            recompute saves fewer tensors than the forward, or one of another
            shape, dtype or device (it stops once all are back, so extra work
            after them is neither run nor counted); ``"values"`` runs the
            recompute to the end, checks the exact count, and fingerprints each
            saved tensor (a float64 sum and position-weighted sum), raising
            when the recomputed values differ; ``"none"`` checks only that no
            tensor is missing.
        **kwargs: keyword arguments for ``function``.

    Returns:
        Whatever ``function`` returns (tensors, containers, non-tensors).

    Raises:
        TypeError: ``function`` is not callable or ``preserve_rng_state`` is not
            a bool.
        ValueError: unknown ``determinism_check``.
        CheckpointError: in backward, when the recompute differs from the forward
            or an input was modified in place after the call.

    Under ``torch.no_grad()`` or ``torch.inference_mode()`` this is a plain call.
    Under ``torch.compile`` it becomes torch's own checkpoint operator, which the
    compiler turns into recomputation in the compiled backward.

    Module buffers are protected from double updates for the modules reachable
    from ``function``: the function itself, the object of a bound method, the
    callable and arguments of a ``functools.partial``, and modules captured in a
    closure. Buffers of modules reached only through globals are not.

    Example:
        >>> import torch, seqckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = seqckpt.checkpoint(block, x)
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])
    """
    if torch.compiler.is_compiling():
        return _compiled_checkpoint(function, args, kwargs, preserve_rng_state)
    _check_arguments(function, preserve_rng_state, determinism_check)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    result: T = _Region(
        function, args, kwargs, preserve_rng_state, determinism_check, None
    ).run()
    return result


def run_region(
    function: Callable[..., T],
    args: tuple[Any, ...],
    *,
    modules: Iterable[nn.Module],
    preserve_rng_state: bool,
    determinism_check: DeterminismCheck,
) -> T:
    """:func:`checkpoint` for callers that already validated the arguments and
    know which modules ``function`` runs (their buffers are protected)."""
    if torch.compiler.is_compiling():
        return _compiled_checkpoint(function, args, {}, preserve_rng_state)
    if not torch.is_grad_enabled():
        return function(*args)
    result: T = _Region(
        function, args, {}, preserve_rng_state, determinism_check, modules
    ).run()
    return result


def _compiled_checkpoint(
    function: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
) -> T:
    # Dynamo turns torch's non-reentrant checkpoint into the
    # tag_activation_checkpoint operator; the partitioner then recomputes.
    import torch.utils.checkpoint as torch_checkpoint

    result: T = torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        **kwargs,
    )
    return result


def _check_arguments(
    function: object, preserve_rng_state: object, determinism_check: object
) -> None:
    if not callable(function):
        raise TypeError(
            "seqckpt: argument 'function' must be callable (a module or a function), "
            f"got {function!r} of type {type(function).__name__}; "
            "call it as seqckpt.checkpoint(block, x)."
        )
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(
            "seqckpt: argument 'preserve_rng_state' must be True or False, "
            f"got {preserve_rng_state!r}."
        )
    if determinism_check not in _CHECKS:
        raise ValueError(
            "seqckpt: argument 'determinism_check' must be one of "
            f"{', '.join(repr(c) for c in _CHECKS)}, got {determinism_check!r}."
        )


def modules_of(function: object) -> list[nn.Module]:
    """The modules a callable visibly runs: itself, a bound method's object, a
    partial's callable and arguments, and modules captured in a closure."""
    if isinstance(function, nn.Module):
        return [function]
    found: list[nn.Module] = []
    _visit(function, 3, found)
    return found


def _visit(obj: object, depth: int, found: list[nn.Module]) -> None:
    # A module-level function, not a closure: a recursive closure is a reference
    # cycle that only the garbage collector frees.
    if isinstance(obj, nn.Module):
        found.append(obj)
    elif depth > 0:
        if isinstance(obj, functools.partial):
            _visit(obj.func, depth - 1, found)
            for a in (*obj.args, *obj.keywords.values()):
                _visit(a, depth - 1, found)
        elif hasattr(obj, "__self__"):
            _visit(obj.__self__, depth - 1, found)
        closure = getattr(obj, "__closure__", None)
        for cell in closure or ():
            try:
                _visit(cell.cell_contents, depth - 1, found)
            except ValueError:  # an empty cell
                continue


def _buffers(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """Every buffer of ``modules`` and their children, each once. Walks the
    ``_modules`` dicts directly: ``Module.buffers()`` costs microseconds per call,
    which matters when every small block is a region."""
    found: dict[int, torch.Tensor] = {}
    visited: set[int] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if id(module) in visited:
            continue
        visited.add(id(module))
        for b in module._buffers.values():
            if b is not None:
                found.setdefault(id(b), b)
        todo.extend(m for m in module._modules.values() if m is not None)
    return list(found.values())


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


def _fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    if t.is_sparse or t.is_quantized or t.is_meta or t.numel() == 0:
        return None
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1).to(torch.float64)
    ramp = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack((flat.sum(), (flat * ramp).sum()))


def _placeholders(obj: Any) -> list[torch.Tensor]:
    return [_EMPTY] * len(tensors_in(obj))


_EMPTY = torch.empty(0)


def _describe(meta: tuple[torch.Size, torch.dtype, torch.device]) -> str:
    shape, dtype, device = meta
    return f"shape {tuple(shape)}, {str(dtype).replace('torch.', '')} on {device}"


def _name(function: object) -> str:
    if isinstance(function, nn.Module):
        return type(function).__name__
    return getattr(function, "__qualname__", None) or type(function).__name__


class _Region:
    """One call of a checkpointed function: what it needs to run again."""

    __slots__ = (
        "function",
        "args",
        "kwargs",
        "inputs",
        "versions",
        "saver",
        "rng",
        "ambient",
        "check",
        "metas",
        "prints",
        "recomputed",
        "buffers",
    )

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        preserve_rng_state: bool,
        check: DeterminismCheck,
        modules: Iterable[nn.Module] | None,
    ) -> None:
        self.function = function
        self.check = check
        self.metas: list[Any] = []
        self.prints: list[torch.Tensor | None] = []
        self.recomputed: list[torch.Tensor | None] | None = None
        inputs = tensors_in(args) if args else []
        if kwargs:
            tensors_in(kwargs, inputs)
        devices = _state.accelerator_devices(inputs)
        self.rng = _state.RngState.capture(devices) if preserve_rng_state else None
        self.ambient = _state.capture_ambient(devices)
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            # Not nested: hold the inputs directly and watch their versions.
            self.inputs: list[torch.Tensor] | None = inputs
            self.versions: list[int] | None = [t._version for t in inputs]
            self.saver = None
        else:
            # Nested in another region (or other saved-tensor hooks): save the
            # inputs through them, so the enclosing region drops them as well.
            dummy = torch.empty((0,), requires_grad=True)
            self.saver = _SaveInputs.apply(dummy, *inputs)  # type: ignore[no-untyped-call]
            self.inputs = None
            self.versions = None
        self.args, self.kwargs = args, kwargs
        mods = modules_of(function) if modules is None else modules
        self.buffers = [(b, b.clone()) for b in _buffers(mods)]

    # ------------------------------------------------------------------ forward

    def run(self) -> Any:
        previous = _state.plain_torchscript()
        _state.enter("checkpointing")
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                output = self.function(*self.args, **self.kwargs)
        finally:
            _state.leave("checkpointing")
            _state.restore_torchscript(previous)
            if self.saver is not None:
                # The saver node holds the inputs now; drop our references.
                self.args = replace_tensors(self.args, _placeholders(self.args))
                self.kwargs = replace_tensors(self.kwargs, _placeholders(self.kwargs))
        # Keep the first-run values only of buffers the forward changed. Kernels
        # such as batch norm update running statistics without bumping the
        # version counter, so compare values, not versions.
        self.buffers = [e for e in self.buffers if not torch.equal(e[0], e[1])]
        return output

    def _pack(self, t: torch.Tensor) -> int:
        index = len(self.metas)
        if self.check == "none":
            self.metas.append(None)
        else:
            self.metas.append((t.shape, t.dtype, t.device))
            if self.check == "values":
                self.prints.append(_fingerprint(t))
        return index

    # ----------------------------------------------------------------- backward

    def _unpack(self, index: int) -> torch.Tensor:
        saved = self.recomputed
        if saved is None or saved[index] is None:
            saved = self.recomputed = self._recompute()
        t = saved[index]
        saved[index] = None  # each saved tensor is unpacked once per backward
        assert t is not None
        return t

    def _current_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.saver is None:
            assert self.inputs is not None and self.versions is not None
            for i, (t, v) in enumerate(zip(self.inputs, self.versions, strict=False)):
                if t._version != v:
                    raise CheckpointError(
                        f"seqckpt: input tensor #{i} (shape {tuple(t.shape)}) of "
                        f"checkpointed {_name(self.function)} was modified in place "
                        "after it was passed in, so the recompute would see other "
                        "values. Pass a clone, or move the in-place operation out of "
                        "the checkpointed function (e.g. nn.ReLU(inplace=False) as "
                        "its first layer)."
                    )
            return self.args, self.kwargs
        assert self.saver.grad_fn is not None
        tensors = list(self.saver.grad_fn.saved_tensors)
        return replace_tensors(self.args, tensors), replace_tensors(
            self.kwargs, tensors[len(tensors_in(self.args)) :]
        )

    def _recompute(self) -> list[torch.Tensor | None]:
        create_graph = torch.is_grad_enabled()
        args, kwargs = self._current_inputs()
        collected: list[torch.Tensor | None] = []
        prints: list[torch.Tensor | None] = []
        fingerprint = self.check == "values"
        # Stop as soon as the last tensor the forward saved is back: what runs
        # after it (the region's last op when it saves only its inputs, a
        # trailing nested region) would be thrown away. "values" runs to the end
        # so that the count is checked exactly.
        wanted = len(self.metas) if not fingerprint else -1
        stopped = False

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal stopped
            detached = t.detach()
            if stopped:  # the function caught the stop and went on
                return detached
            collected.append(t if create_graph else detached)
            if fingerprint:  # now: a saved buffer may change after the recompute
                prints.append(_fingerprint(detached))
            if len(collected) == wanted:
                stopped = True
                raise _StopRecompute
            return detached

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t

        caller_rng = self.rng.current() if self.rng is not None else None
        post = [(b, b.clone()) for b, _ in self.buffers]
        previous = _state.plain_torchscript()
        _state.enter("recomputing")
        try:
            for b, pre in self.buffers:
                b.copy_(pre)
            if self.rng is not None:
                self.rng.restore()
            try:
                with (
                    _state.replay_ambient(self.ambient, None) or nullcontext(),
                    torch.enable_grad(),
                    torch.autograd.graph.saved_tensors_hooks(pack, unpack),
                ):
                    self.function(*args, **kwargs)
            except Exception:
                # Our stop arrives as _StopRecompute, or as a RuntimeError when
                # it crossed TorchScript; anything raised before it is the user's.
                if not stopped:
                    raise
        finally:
            _state.leave("recomputing")
            _state.restore_torchscript(previous)
            if caller_rng is not None:
                caller_rng.restore()
            with torch.no_grad():
                for b, value in post:
                    b.copy_(value)
        self._verify(collected, prints)
        return collected

    def _verify(
        self, collected: list[torch.Tensor | None], prints: list[torch.Tensor | None]
    ) -> None:
        name = _name(self.function)
        if len(collected) != len(self.metas):
            raise CheckpointError(
                f"seqckpt: the recompute of checkpointed {name} saved "
                f"{len(collected)} tensors for backward, but its forward saved "
                f"{len(self.metas)}. The function must do the same work twice: make "
                "any state it branches on (flags, Python randomness, data-dependent "
                "control flow) the same in backward, or do not checkpoint it."
            )
        if self.check == "none":
            return
        for i, (t, meta) in enumerate(zip(collected, self.metas, strict=False)):
            assert t is not None
            now = (t.shape, t.dtype, t.device)
            if now != meta:
                raise CheckpointError(
                    f"seqckpt: saved tensor #{i} of checkpointed {name} differs "
                    f"between forward ({_describe(meta)}) and recompute "
                    f"({_describe(now)}). The function must compute the same "
                    "thing twice; check global state it reads."
                )
        if self.check == "values":
            for i, (before, after) in enumerate(zip(self.prints, prints, strict=False)):
                if before is None or after is None:
                    continue
                if not torch.allclose(before, after, rtol=0, atol=0, equal_nan=True):
                    raise CheckpointError(
                        f"seqckpt: saved tensor #{i} of checkpointed {name} "
                        f"({_describe(self.metas[i])}) has other values in the "
                        "recompute than in forward (fingerprints "
                        f"{before.tolist()} vs {after.tolist()}). Something "
                        "nondeterministic runs inside: RNG outside torch, "
                        "nondeterministic kernels, or state changed between the runs."
                    )
