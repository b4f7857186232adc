"""Module buffers inside a checkpointed region: found before the region first
runs, their first-run values kept where that run may have changed them, and put
in place around the recompute so that it sees what the first run saw and
updates nothing a second time. Likewise the tensors ``torch.func.functional_call``
puts in parameter and buffer slots for a call (MAML, model ensembles): by the
time backward recomputes, the modules hold their own tensors again, so the
stand-ins the first run used are put back around the recompute.

Which modules a region runs is read off the callable (:func:`modules_of`): the
module itself, the object of a bound method (HF's ``layer.__call__``), the
callable and arguments of a ``functools.partial``, what a closure captures
(timm's ``checkpoint_seq`` and torch's ``run_function`` close over a tuple or
list of modules) or binds as default arguments (``lambda t, block=block:
block(t)`` in a loop), what an object holds in its attributes or slots (a
callable object, or a script's own class that a lambda closes over), and
modules inside tuples, lists, deques, dicts and sets of any of those or behind
a weak reference, four levels deep, and the modules (and generators) its code
names as globals (``def run(x): return model.encoder(x)`` in a script). A
module reached only through a global object's attributes (``trainer.model``
named in the code) is not visible that way; :func:`watching_modules` finds
every module a region calls, however it is reached, with a global forward
pre-hook.
It costs a few microseconds per module call (the hook moves every module call
onto ``nn.Module``'s slow path), so it runs only with
``determinism_check="values"``. The buffers of each module found and of all its
submodules are recorded (TorchScript submodules included).

Which buffers the first run may have changed is decided without reading their
values, so no device synchronisation is needed:

- the version counter moved: any in-place write from Python, or from a kernel
  that declares it;
- the module put another tensor in its place (``self.steps = self.steps + 1``);
- ``running_mean`` / ``running_var`` of a module in training mode: batch-norm
  kernels update running statistics without moving the version counter
  (except where the module is a batch norm whose forward adds one to
  ``num_batches_tracked`` at every update, torch's or timm's copy of it, and
  that did not move: a closure over all of a model's blocks reaches many a
  region never runs);
- any floating-point buffer of a TorchScript module in training mode (what
  runs inside is not visible);
- every buffer of a quantization-aware-training fake-quantizer or observer
  (``torch.ao.quantization``): the fused kernel behind its default QAT
  configuration updates running min/max, scale and the integer zero point
  without moving their version counters;
- with ``conservative=True`` (``determinism_check="values"``), every
  floating-point buffer.

The first-run copies of the others are dropped when the first run ends; only
the tensor objects are kept, to be put back where a slot holds another one by
the time of the recompute (a ``functional_call`` stand-in).

A buffer of :data:`COPY_LIMIT` bytes or more that is also larger than the
region's inputs (a causal mask, a table of decay factors or positions, beside
small activations) is not copied when the region starts, where the copy would
add its size to the region's peak and most such buffers are never written: a
dispatch mode (:class:`WriteWatch`) sees every op of the first run and copies
the buffer just before the first op that writes into its memory (through any
view or ``.data`` alias). Beside larger inputs the copy is a small part of
the region's memory and cheaper than the mode's Python cost per op. A write
the mode cannot see (a kernel outside PyTorch's dispatcher that moves the
version counter) is an error: its first values are gone.
``conservative=True`` copies every buffer up front.

Internal: nothing here is public API.
"""

from __future__ import annotations

import collections
import dis
import functools
import itertools
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from seqckpt._state import _GENERATOR, generators_held, unseen
from seqckpt._writes import written_by

__all__ = [
    "COPY_LIMIT",
    "BufferGuard",
    "WriteWatch",
    "bound_by",
    "is_parameter",
    "modules_of",
    "survey",
    "watching_modules",
]

_HIDDEN_WRITES = frozenset({"running_mean", "running_var"})
# Forwards that add one to num_batches_tracked whenever they update the
# running statistics (an override of its own may not; InstanceNorm does not):
# torch's, and those of timm's batch norms with an activation (a copy of
# torch's forward, and SyncBatchNorm's called; checked against timm 1.0.31),
# added once timm is loaded.
_COUNTING_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward}
_TIMM_NORMS = ["BatchNormAct2d", "SyncBatchNormAct"]  # emptied once added


def _counting_forwards() -> set[Any]:
    norm_act = sys.modules.get("timm.layers.norm_act") if _TIMM_NORMS else None
    if norm_act is not None:
        for name in _TIMM_NORMS:
            cls = getattr(norm_act, name, None)
            if cls is not None:
                _COUNTING_FORWARDS.add(cls.forward)
        _TIMM_NORMS.clear()
    return _COUNTING_FORWARDS


def _quantizer_types() -> tuple[type, ...]:
    try:
        from torch.ao.quantization.fake_quantize import FakeQuantizeBase
        from torch.ao.quantization.observer import ObserverBase
    except ImportError:  # a torch without the (deprecated) eager QAT modules
        return ()
    return (FakeQuantizeBase, ObserverBase)


_QUANTIZERS = _quantizer_types()


def modules_of(
    function: object,
    generators: list[torch.Generator] | None = None,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> list[nn.Module]:
    """The modules a callable visibly runs (see the module docstring), also
    those among (or held by) the arguments it is called with
    (``checkpoint(run, block, x)``); the ``torch.Generator`` objects the walk
    meets on the way (a closure over one) are added to ``generators`` where
    it is given.

    Example:
        >>> from torch import nn
        >>> def chunk(blocks):  # timm's checkpoint_seq closes over its modules
        ...     def run(x):
        ...         for block in blocks:
        ...             x = block(x)
        ...         return x
        ...     return run
        >>> [type(m).__name__ for m in modules_of(chunk((nn.Linear(2, 2), nn.Tanh())))]
        ['Linear', 'Tanh']
    """
    # (tensors and flags, the usual arguments, hold no modules: not walked)
    level: list[object] = [a for a in args if type(a) not in _LEAVES]
    if kwargs:
        level.extend(a for a in kwargs.values() if type(a) not in _LEAVES)
    if not level and isinstance(function, nn.Module):
        return [function]
    level.insert(0, function)
    # Breadth first, so that the modules nearest the callable are found before
    # the walk spends its budget on a large object graph it reached (a closure
    # over a training script's object that also holds the dataset).
    found: dict[int, nn.Module] = {}
    seen: set[int] = set()
    budget = _WALK_BUDGET
    for depth in range(_WALK_DEPTH + 1):
        below: list[object] = []
        for obj in level:
            if isinstance(obj, nn.Module):
                found.setdefault(id(obj), obj)
            elif type(obj) is _GENERATOR:
                if generators is not None:
                    generators_held((obj,), generators)
            elif (
                depth < _WALK_DEPTH
                and budget > len(below)
                and id(obj) not in seen
                and not isinstance(obj, (str, bytes, int, float))
            ):
                seen.add(id(obj))
                below.extend(itertools.islice(_held_by(obj), budget - len(below)))
        budget -= len(below)
        level = below
    return list(found.values())


# Argument types that cannot hold a module
_LEAVES = frozenset({torch.Tensor, type(None), bool, int, float, str})

# How far (objects away from the callable) and how many objects the module
# walk looks: bounded, because it runs at every call of a region.
_WALK_DEPTH = 4
_WALK_BUDGET = 256


def _held_by(obj: object) -> Iterator[object]:
    """The objects ``obj`` holds that the module walk looks into."""
    if isinstance(obj, (tuple, list, set, frozenset, collections.deque)):
        yield from obj
    elif isinstance(obj, weakref.ref):  # a module held weakly
        yield obj()
    elif isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
    elif isinstance(obj, (types.FunctionType, types.MethodType)):
        yield getattr(obj, "__self__", None)
        yield from bound_by(obj)
        yield getattr(obj, "__wrapped__", None)
        yield from _globals_used(obj)
    elif isinstance(obj, (type, types.ModuleType, torch.Tensor)):
        return
    else:
        # an object's attributes: a callable object's, or a training script's
        # own class a lambda closes over (``lambda h: self.model(h)``), in its
        # __dict__ and its slots (``@dataclass(slots=True)``)
        attributes = _plain_attribute(obj, "__dict__")
        slots = _slot_names(type(obj))
        if attributes is None and not slots:
            yield _plain_attribute(obj, "__self__")  # a bound builtin method
            return
        if attributes is not None:
            yield from attributes.values()
        for name in slots:
            yield _plain_attribute(obj, name)


def bound_by(function: object) -> Iterator[object]:
    """What a function (or a method's function) holds in its closure and
    binds as default arguments (``lambda t, block=block: block(t)``)."""
    for cell in getattr(function, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    yield from getattr(function, "__defaults__", None) or ()
    yield from (getattr(function, "__kwdefaults__", None) or {}).values()


def _globals_used(function: types.FunctionType | types.MethodType) -> Iterator[object]:
    """The modules and generators ``function`` reaches through the globals its
    code names (``def run(x): return model.encoder(x)`` in a script), read
    from its module's namespace at each call: a global rebound between calls
    is found as it is then. Other globals (functions, plain objects) are not
    walked into: a library function's namespace holds nothing of the user's."""
    code = getattr(function, "__code__", None)
    namespace = getattr(function, "__globals__", None)
    if type(code) is not types.CodeType or type(namespace) is not dict:
        return
    for name in _global_names(code):
        value = namespace.get(name)
        if isinstance(value, nn.Module) or type(value) is _GENERATOR:
            yield value


_TORCH_SOURCE = os.path.dirname(torch.__file__) + os.sep
_NAMES: weakref.WeakKeyDictionary[types.CodeType, tuple[str, ...]] = (
    weakref.WeakKeyDictionary()
)


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` and the code nested in it (comprehensions, inner
    functions) load as globals, cached per code object: not the attribute
    names (``self.model`` does not reach a global ``model``); none for
    torch's own code (``nn.Module.__call__``, which HF's layers checkpoint):
    its namespace holds no module of the user's."""
    known = _NAMES.get(code)
    if known is not None:
        return known
    if code.co_filename.startswith(_TORCH_SOURCE):
        _NAMES[code] = ()
        return ()
    names = dict.fromkeys(
        i.argval
        for i in dis.get_instructions(code)
        if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    )
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names.update(dict.fromkeys(_global_names(constant)))
    _NAMES[code] = found = tuple(names)
    return found


_SLOTS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _slot_names(cls: type) -> tuple[str, ...]:
    """The attribute names of the slots ``cls`` and its bases declare (private
    names as Python mangles them)."""
    known = _SLOTS.get(cls)
    if known is not None:
        return known
    names: list[str] = []
    for klass in cls.__mro__:
        declared = klass.__dict__.get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            names.append(name)
    _SLOTS[cls] = found = tuple(names)
    return found


def _plain_attribute(obj: object, name: str) -> Any:
    """``obj.name`` as plain lookup finds it, or None: a class's own
    ``__getattr__`` or ``__getattribute__`` (a proxy's) is not run, as it may
    raise anything or have effects."""
    try:
        return object.__getattribute__(obj, name)
    except AttributeError:
        return None


@contextmanager
def watching_modules(seen: Callable[[nn.Module], None]) -> Iterator[None]:
    """Call ``seen(module)`` before every module call made by this thread in the
    block, however the module is reached."""
    owner = threading.get_ident()

    def pre_hook(module: nn.Module, args: object) -> None:
        if threading.get_ident() == owner:
            seen(module)

    handle = register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()


_Parameter, _Tensor = nn.Parameter, torch.Tensor


def is_parameter(t: object) -> bool:
    """``isinstance(t, nn.Parameter)`` without the Python ``__instancecheck__``
    for plain tensors and parameters, which are told apart by their type."""
    kind = type(t)
    return kind is _Parameter or (kind is not _Tensor and isinstance(t, _Parameter))


def _stand_in(p: torch.Tensor | None) -> bool:
    """A tensor in a module's parameter slot that is not a Parameter: put there
    for the call by ``torch.func.functional_call`` (torch.nn.utils.stateless),
    which puts the module's own parameters back when the call returns, before
    any recompute. Not asked of TorchScript modules: functional_call cannot
    swap their parameters, and a deep copy of one holds them as plain
    tensors."""
    return p is not None and not is_parameter(p)


# Per module class: (whether it may hold a generator of its own: torch.nn's
# modules (Linear, Sequential, ...) never do, so their attributes are not
# looked at; whether it is lazy (``nn.LazyLinear``); whether it is ``nn.RReLU``;
# whether it is a TorchScript module)
_KINDS: dict[type, tuple[bool, bool, bool, bool]] = {}


def _kind(kind: type) -> tuple[bool, bool, bool, bool]:
    if len(_KINDS) >= 4096:  # classes made per module (parametrize does) come and go
        _KINDS.clear()
    where = getattr(kind, "__module__", None) or ""  # (None when made so)
    flags = (
        not where.startswith("torch.nn.modules."),
        issubclass(kind, LazyModuleMixin),
        issubclass(kind, nn.RReLU),
        issubclass(kind, torch.jit.ScriptModule),
    )
    _KINDS[kind] = flags
    return flags


def survey(
    modules: Iterable[nn.Module], generators: list[torch.Generator]
) -> tuple[nn.Module | None, bool, list[nn.Module], bool]:
    """One walk over ``modules`` and their submodules: (a lazy module
    (``nn.LazyLinear`` and the like) whose parameters are not initialized yet,
    or None; whether any holds a buffer or a stand-in for a parameter; every
    module walked, a shared one as often as it is reached; whether one saves a
    tensor for backward before its kernel fills it). The ``torch.Generator``
    objects the modules hold as attributes are added to ``generators``.

    The last is ``nn.RReLU`` in training mode: ``rrelu_with_noise`` saves its
    noise tensor before writing into it, without moving its version counter,
    so a recompute stopped at that save would keep it unfilled (wrong
    gradients, no error; torch's checkpoint as well). Such a region's
    recompute runs to its end. Only modules are seen (a functional
    ``F.rrelu`` is not)."""
    lazy: nn.Module | None = None
    state = unfilled = False
    walked: list[nn.Module] = []
    todo = list(modules)
    while todo:
        m = todo.pop()
        if m is None:  # a submodule slot set to None after construction
            continue
        walked.append(m)
        kind = type(m)
        custom, lazy_kind, rrelu, script = _KINDS.get(kind) or _kind(kind)
        if custom and _GENERATOR in set(map(type, attributes := m.__dict__.values())):
            generators_held(attributes, generators)
        if not state:
            if m._buffers:
                state = True
            elif not script:  # (_stand_in asked only of what is not a Parameter)
                for p in m._parameters.values():
                    if type(p) is not _Parameter and _stand_in(p):
                        state = True
                        break
        if lazy_kind and lazy is None and m.has_uninitialized_params():  # type: ignore[operator]
            lazy = m
        if rrelu and m.training:
            unfilled = True
        todo.extend(m._modules.values())  # type: ignore[arg-type]
    return lazy, state, walked, unfilled


# Bytes from which a buffer is copied at its first write in a region's first
# run (see the module docstring) rather than when the region starts
COPY_LIMIT = 64 * 1024


def _dense(t: torch.Tensor) -> bool:
    """A plain strided tensor with memory (one a buffer copy is made of)."""
    return type(t) is _Tensor and t.layout is torch.strided and not t.is_meta


class WriteWatch(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Active during a region's first run when its guard defers buffers: hands
    every op's written tensors to :meth:`BufferGuard.before_write` before the
    op runs."""

    def __init__(self, guard: BufferGuard) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.guard = guard

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.guard.unwritten and (written := written_by(func, args, kwargs)):
            self.guard.before_write(written)
        return func(*args, **kwargs)


def _snapshot(b: torch.Tensor) -> torch.Tensor:
    """A copy of ``b``, made unseen by dispatch modes (see ``_state.unseen``)."""
    return unseen(_copy, b)


def _copy(b: torch.Tensor) -> torch.Tensor:
    return (b.detach() if b.requires_grad else b).clone()


def _assign(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Give ``tensor`` the shape and values of ``values`` in place (an
    observer's per-channel min/max start empty and are resized on first use),
    leaving its version counter where it was: the guard's writes are undone
    by the guard before backward reads anything, and a buffer that an op
    outside the region's hooks saved (the same batch norm called outside a
    region too, or inside a seqckpt.keep call) would otherwise fail autograd's
    check that it was not modified in place."""
    version = tensor._version
    if tensor.shape != values.shape:
        tensor.resize_(values.shape)
    tensor.copy_(values)
    _set_version(tensor, version)


def _set_version(tensor: torch.Tensor, version: int) -> None:
    try:
        _SET_VERSIONS((tensor,), (version,))
    except TypeError:  # (older torch takes one tensor and one int)
        _SET_VERSIONS(tensor, version)


_SET_VERSIONS: Any = getattr(
    torch._C._autograd, "_unsafe_set_version_counter", lambda *args: None
)


def _held(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor ``module`` holds as buffer ``name`` now (TorchScript modules
    wrap their buffers in a mapping without ``get``)."""
    try:
        held: torch.Tensor | None = module._buffers[name]
    except KeyError:
        return None
    return held


def _put(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    if isinstance(module, torch.jit.ScriptModule):
        setattr(module, name, tensor)
    else:
        module._buffers[name] = tensor


# What BufferGuard.restore puts back per slot: (module, name, whether it is a
# parameter slot, the tensor the slot held before the replay, (tensor, its
# values before the replay) where the replay wrote first-run values into it)
Undo = tuple[
    nn.Module,
    str,
    bool,
    torch.Tensor | None,
    tuple[torch.Tensor, torch.Tensor] | None,
]


class BufferGuard:
    """The buffers of the modules one region runs, with their first-run values,
    and the stand-ins ``torch.func.functional_call`` put in their parameter
    and buffer slots (the recompute must compute with those, not with the
    tensors the modules hold again by then).

    ``watch`` is the pre-hook callback during the first run; ``settle`` keeps
    the values of what may have changed once it ends, and only the tensor
    object of the other buffers; ``replay`` puts the first-run tensors and
    values in place for a recompute and returns what :meth:`restore` needs to
    put back the caller's.
    """

    __slots__ = (
        "conservative",
        "visited",
        "entries",
        "stand_ins",
        "held",
        "deferred",
        "unwritten",
    )

    @staticmethod
    def of(
        modules: Iterable[nn.Module],
        conservative: bool,
        inputs: list[torch.Tensor] | None = None,
    ) -> BufferGuard | None:
        """A guard over the buffers of ``modules`` and their submodules; None
        when there are none (and none can be found later: not conservative).
        ``inputs``: the region's input tensors (see the module docstring)."""
        guard = BufferGuard(conservative)
        for module in modules:
            guard.watch(module, inputs or ())
        if guard.entries or guard.stand_ins or guard.deferred or conservative:
            return guard
        return None

    def __init__(self, conservative: bool) -> None:
        self.conservative = conservative
        self.visited: set[int] | None = set()
        # (module, name, tensor, version at first sight, first value, may be
        # written by a kernel without a version bump)
        self.entries: list[
            tuple[nn.Module, str, torch.Tensor, int, torch.Tensor, bool]
        ] = []
        # (module, name, tensor): parameter stand-ins, and (after settle) the
        # buffers the first run left as they were
        self.stand_ins: list[tuple[nn.Module, str, torch.Tensor]] = []
        self.held: list[tuple[nn.Module, str, torch.Tensor]] = []
        # Buffers copied at their first write (_copied_when_written):
        # (module, name, tensor, version at first sight, first value or None),
        # and by storage those not written yet (indices into deferred)
        self.deferred: list[list[Any]] = []
        self.unwritten: dict[int, list[int]] = {}

    def watch(self, module: nn.Module, inputs: Sequence[torch.Tensor] = ()) -> None:
        """Record the buffers of ``module`` and its submodules (``inputs``:
        the region's, see :meth:`_copied_when_written`)."""
        visited = self.visited
        if visited is None or id(module) in visited:
            return
        todo = [module]
        while todo:
            m = todo.pop()
            if id(m) in visited:
                continue
            visited.add(id(m))
            kind = type(m)
            script = (_KINDS.get(kind) or _kind(kind))[3]
            for name, p in () if script else m._parameters.items():
                if type(p) is not _Parameter and _stand_in(p):
                    assert p is not None
                    self.stand_ins.append((m, name, p))
            buffers = m._buffers
            if buffers:
                quantizer = isinstance(m, _QUANTIZERS)
                for name, b in buffers.items():
                    if b is None:
                        continue
                    hidden = quantizer or (
                        b.is_floating_point()
                        and (
                            self.conservative
                            or (m.training and (script or name in _HIDDEN_WRITES))
                        )
                    )
                    if hidden or not self._copied_when_written(b, inputs):
                        self.entries.append(
                            (m, name, b, b._version, _snapshot(b), hidden)
                        )
                    else:
                        key = b.untyped_storage()._cdata
                        self.unwritten.setdefault(key, []).append(len(self.deferred))
                        self.deferred.append([m, name, b, b._version, None])
            todo.extend(sub for sub in m._modules.values() if sub is not None)

    def _copied_when_written(
        self, b: torch.Tensor, inputs: Sequence[torch.Tensor]
    ) -> bool:
        """Whether ``b`` is copied at its first write rather than now: a
        dense tensor of COPY_LIMIT bytes or more, larger than ``inputs``."""
        if self.conservative or not _dense(b):
            return False
        size = b.numel() * b.element_size()
        return size >= COPY_LIMIT and size > sum(
            t.numel() * t.element_size() for t in inputs
        )

    def before_write(self, written: list[torch.Tensor]) -> None:
        """Copy the deferred buffers whose memory an op is about to write."""
        for t in written:
            if not _dense(t):
                continue
            for i in self.unwritten.pop(t.untyped_storage()._cdata, ()):
                entry = self.deferred[i]
                entry[4] = _snapshot(entry[2])

    def copy_deferred(self) -> None:
        """Copy the deferred buffers now, as the smaller ones are (where no
        dispatch mode may run: torch.compile would not compile under it)."""
        for module, name, tensor, version, _ in self.deferred:
            self.entries.append(
                (module, name, tensor, version, _snapshot(tensor), False)
            )
        self.deferred, self.unwritten = [], {}

    def _deferred_entries(self) -> list[tuple[Any, ...]]:
        """The deferred buffers written so far, as entries (kept whatever their
        version counter says: the write may be one that does not move it)."""
        return [
            (m, n, b, v, first, True)
            for m, n, b, v, first in self.deferred
            if first is not None
        ]

    def settle(self) -> str | None:
        """The first run ended: keep the first values of the buffers it may
        have changed; of the others only the tensor (``functional_call`` may
        have put it there for this call only). Returns what went wrong where a
        deferred buffer was written unseen (its first values are gone)."""
        self.visited = None
        lost = None
        for module, name, tensor, version, first in self.deferred:
            if first is None and tensor._version != version:
                lost = (
                    f"seqckpt: buffer {name!r} of {type(module).__name__} was "
                    "written during the checkpointed forward by something that "
                    "PyTorch's dispatcher does not see (its version counter "
                    "moved, but no op wrote into it), so its first values, which "
                    "the recompute needs, are gone. Pass "
                    'determinism_check="values" (every buffer is copied '
                    "when the region starts), or write it with torch operations."
                )
            elif first is None:
                self.held.append((module, name, tensor))
        self.entries += self._deferred_entries()
        self.deferred, self.unwritten = [], {}
        idle = () if self.conservative else self._batch_norms_not_run()
        changed = []
        for e in self.entries:
            module, name, tensor, version, _, hidden = e
            if (
                (hidden and not (id(module) in idle and name in _HIDDEN_WRITES))
                or tensor._version != version
                or _held(module, name) is not tensor
            ):
                changed.append(e)
            else:
                self.held.append((module, name, tensor))
        self.entries = changed
        return lost

    def _batch_norms_not_run(self) -> set[int]:
        """The batch norms whose running statistics the first run cannot have
        updated: their forward (torch's, or timm's copy of it) counts every
        update in ``num_batches_tracked``, whose version did not move. (A closure over
        all of a model's blocks, as timm's ``checkpoint_seq`` makes, reaches
        many that the region never runs; their statistics need no copy.)"""
        counting = _counting_forwards()
        return {
            id(module)
            for module, name, tensor, version, _, _ in self.entries
            if name == "num_batches_tracked"
            and isinstance(module, nn.modules.batchnorm._NormBase)
            and type(module).forward in counting
            and tensor._version == version
            and _held(module, name) is tensor
        }

    def replay(self) -> list[Undo] | None:
        """Put the first-run tensors and values in place; returns what
        :meth:`restore` needs, or None when there was nothing to put."""
        moved = [h for h in self.held if _held(h[0], h[1]) is not h[2]]
        if not (self.entries or self.stand_ins or moved or self.deferred):
            return None
        return unseen(self._replay, moved)

    def _replay(self, moved: list[tuple[nn.Module, str, torch.Tensor]]) -> list[Undo]:
        undo: list[Undo] = []
        with torch.no_grad():
            for module, name, tensor in self.stand_ins:
                own: torch.Tensor | None = module._parameters.get(name)
                module._parameters[name] = tensor  # type: ignore[assignment]
                undo.append((module, name, True, own, None))
            for module, name, tensor in moved:
                undo.append((module, name, False, _held(module, name), None))
                _put(module, name, tensor)
            # (deferred: a backward inside the first run, before settle)
            assigned: set[int] = set()  # (one tensor may sit in several slots)
            for module, name, tensor, _, first, _ in (
                self.entries + self._deferred_entries()
            ):
                now = _held(module, name)
                values = None
                if id(tensor) not in assigned:
                    assigned.add(id(tensor))
                    values = (tensor, _copy(tensor))
                    _assign(tensor, first)
                if now is not tensor:
                    _put(module, name, tensor)
                undo.append((module, name, False, now, values))
        return undo

    def restore(self, undo: list[Undo]) -> None:
        """Put back the values and tensors the caller had before :meth:`replay`."""
        unseen(self._restore, undo)

    def _restore(self, undo: list[Undo]) -> None:
        with torch.no_grad():
            for module, name, parameter, now, values in undo:
                if values is not None:
                    tensor, after = values
                    _assign(tensor, after)
                    if now is tensor:
                        continue
                if parameter:  # the module's own parameter back
                    module._parameters[name] = now  # type: ignore[assignment]
                elif now is not None:
                    _put(module, name, now)
