"""Selective saving: what a checkpointed region keeps instead of recomputing.

A region with a policy keeps, during its forward, the outputs of the ops the
policy selects (matmuls, convolutions, attention: the expensive ones) and
recomputes everything else in backward; the recompute serves the kept outputs
instead of running those ops again. A policy is plain data, so plans carry it
and save it to JSON:

- ``None``: keep nothing (the region keeps only its inputs);
- ``"compute_heavy"`` (:data:`COMPUTE_HEAVY`): the matmul family, convolutions
  and fused scaled-dot-product attention;
- a collection of aten ops (``torch.ops.aten.mm`` or overloads such as
  ``torch.ops.aten.mm.default``, or names such as ``"aten::mm"``), one such op
  alone, or :func:`ops`;
- :func:`names`: the tensors marked in user code with :func:`seqckpt.name`, so
  a model author says what to keep without knowing aten (as JAX's
  ``save_only_these_names`` with ``checkpoint_name``); under ``torch.compile``
  a kept name is an op of the graph that torch's selective checkpointing saves;
- a callable ``policy(op, *args, **kwargs) -> bool`` (True: keep this op's
  output); works in eager mode and under ``torch.compile``, but a plan holding
  one cannot be written to JSON. A policy written for torch's selective
  checkpointing, ``policy(ctx, op, *args, **kwargs)`` returning a
  ``CheckpointPolicy``, works too: its first parameter named ``ctx`` tells it
  apart; ``MUST_SAVE`` / ``PREFER_SAVE`` keep, the ``*_RECOMPUTE`` answers do
  not, and ``*_CPU_OFFLOAD`` keeps the output where it is.

:func:`seqckpt.what_is_kept` lists, op by op, what a policy keeps for one call.

Example:
    >>> import torch, seqckpt
    >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(),
    ...                             torch.nn.Linear(8, 8))
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = seqckpt.checkpoint(block, x, policy="compute_heavy")
    >>> y.sum().backward()   # both matmuls are served, only GELU is recomputed
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from seqckpt._state import generator_key, philox_state, put_philox_state
from seqckpt._tree import storages_in
from seqckpt._writes import written_by

__all__ = ["COMPUTE_HEAVY", "Policy", "as_policy", "name", "names", "ops"]

_HEAVY_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_int_mm",
    "aten::_scaled_mm",
    "aten::convolution",
    "aten::_convolution",
    "aten::cudnn_convolution",
    "aten::mkldnn_convolution",
    "aten::convolution_overrideable",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
)


# Every name a names policy keeps (see name(): under torch.compile only these
# become ops of the graph).
_POLICY_NAMES: set[str] = set()


def _define_name_op() -> Any:
    """``seqckpt::named(tensor, label)``: a copy of ``tensor``, differentiable
    as the identity; what :func:`name` puts in a compiled graph."""
    try:
        named = torch.library.custom_op("seqckpt::named", mutates_args=())(_copy_named)
    except RuntimeError:  # defined already (the module imported again)
        return torch.ops.seqckpt.named.default
    named.register_fake(_copy_named_fake)
    named.register_autograd(_named_backward)
    return torch.ops.seqckpt.named.default


def _copy_named(tensor: torch.Tensor, label: str) -> torch.Tensor:
    return tensor.clone()


def _copy_named_fake(tensor: torch.Tensor, label: str) -> torch.Tensor:
    return torch.empty_like(tensor)


def _named_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_NAME_OP = _define_name_op()


@dataclass(frozen=True)
class Policy:
    """Which results a checkpointed region keeps in forward.

    Attributes:
        ops: aten op names (``"aten::mm"`` for every overload, or
            ``"aten::mm.default"`` for one) whose outputs are kept.
        names: names given with :func:`seqckpt.name` whose tensors are kept.
        label: a short name used when the policy is printed (``"compute_heavy"``).
        keep: a user callable ``(op, *args, **kwargs) -> bool``, or None.
        source: the callable the user gave (``keep`` or what ``keep`` wraps);
            policies are equal where their sources are the same object, so two
            different callables are two policies, however they print.
    """

    ops: frozenset[str] = frozenset()
    names: frozenset[str] = frozenset()
    label: str | None = None
    keep: Callable[..., bool] | None = field(default=None, compare=False)
    source: Callable[..., Any] | None = field(default=None, repr=False)
    torch_context_fn: Callable[[], Any] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if self.source is None and self.keep is not None:
            object.__setattr__(self, "source", self.keep)
        # torch's selective checkpointing for torch.compile, made here, before
        # any tracing: dynamo takes a context_fn only as a constant.
        object.__setattr__(self, "torch_context_fn", _torch_selective(self))
        _POLICY_NAMES.update(self.names)

    def keeps(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the output of aten op ``func`` called with these arguments
        is kept. Names reach it only as the graph op a compiled
        :func:`seqckpt.name` becomes; in eager mode the region's ``Keeping``
        mode is told of each named tensor directly (see :func:`seqckpt.name`)."""
        return _keeps(self.ops, self.names, self.keep, func, args, kwargs)

    def __str__(self) -> str:
        if self.label is not None:
            return self.label
        parts = sorted(self.ops) + [f"name:{n}" for n in sorted(self.names)]
        if self.keep is not None:
            parts.append(getattr(self.keep, "__name__", "callable"))
        return "keep(" + ", ".join(parts) + ")"

    def to_json(self) -> Any:
        if self.keep is not None:
            raise ValueError(
                f"seqckpt: policy {self} holds a Python callable, which JSON "
                "cannot hold; use ops or names to save the plan."
            )
        if self.label is not None and self == POLICIES.get(self.label):
            return self.label
        return {"ops": sorted(self.ops), "names": sorted(self.names)}

    @staticmethod
    def from_json(data: Any) -> Policy:
        if isinstance(data, str) and data in POLICIES:
            return POLICIES[data]
        if isinstance(data, dict) and set(data) <= {"ops", "names"}:
            return Policy(
                frozenset(str(o) for o in data.get("ops", ())),
                frozenset(str(n) for n in data.get("names", ())),
            )
        raise ValueError(f"seqckpt: not a policy: {data!r}")


def _keeps(
    ops: Collection[str],
    names: Collection[str],
    keep: Callable[..., bool] | None,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bool:
    if ops:
        schema = func._schema
        if schema.name in ops:
            return True
        if f"{schema.name}.{schema.overload_name or 'default'}" in ops:
            return True
    if names and func is _NAME_OP and args[1] in names:
        return True  # a name in a compiled graph (see name())
    if keep is None:
        return False
    decision = keep(func, *args, **kwargs)
    if decision is True or decision is False:
        return decision
    return _kept_by(decision)


def _kept_by(decision: object) -> bool:
    """A callable policy's answer as a bool. torch's ``CheckpointPolicy``
    values (the answers of a policy written for torch's selective
    checkpointing) count by their meaning, not their truth (every enum member
    is true): ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE`` do not keep, the
    others keep (``*_CPU_OFFLOAD``: kept where the output is, not offloaded)."""
    if isinstance(decision, CheckpointPolicy):
        return decision not in (
            CheckpointPolicy.MUST_RECOMPUTE,
            CheckpointPolicy.PREFER_RECOMPUTE,
        )
    return bool(decision)


def _takes_ctx(policy: Callable[..., Any]) -> bool:
    """Whether ``policy`` is written for torch's selective checkpointing:
    ``policy(ctx, op, *args, **kwargs)``, its first parameter named ``ctx``."""
    function = getattr(policy, "__func__", policy)  # a bound method: its function
    code = getattr(function, "__code__", None)
    if code is not None:  # read off the code object (a signature costs ~7 us)
        skip = int(function is not policy)  # a bound method's self
        named = code.co_varnames[: code.co_argcount]
        return len(named) > skip and named[skip] == "ctx"
    try:
        first = next(iter(inspect.signature(policy).parameters.values()), None)
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return first is not None and first.name == "ctx"


# What a torch selective-checkpointing policy is asked with: seqckpt asks only
# in forward (made here: dynamo refuses to trace its constructor).
_FORWARD_CTX = SelectiveCheckpointContext(is_recompute=False)


def _in_forward(policy: Callable[..., Any], op: Any, *args: Any, **kwargs: Any) -> Any:
    """A torch selective-checkpointing policy asked as ``keep(op, ...)`` is (a
    partial of it is what dynamo can take as a constant)."""
    return policy(_FORWARD_CTX, op, *args, **kwargs)


def _torch_selective(policy: Policy) -> Callable[[], Any]:
    """The policy as torch's selective checkpointing: the ops it keeps must be
    saved, everything else is recomputed. Made of partials of module-level
    functions over the policy's parts, which dynamo can take as a constant even
    where the policy is made while it traces (a list or callable given inside
    a compiled function)."""
    decide = functools.partial(
        _sac_decision,
        tuple(sorted(policy.ops)),
        tuple(sorted(policy.names)),
        policy.keep,
    )
    return functools.partial(create_selective_checkpoint_contexts, decide)


def _sac_decision(
    ops: tuple[str, ...],
    names: tuple[str, ...],
    keep: Callable[..., bool] | None,
    ctx: Any,
    func: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if _keeps(ops, names, keep, func, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


COMPUTE_HEAVY = Policy(frozenset(_HEAVY_OPS), label="compute_heavy")
POLICIES = {"compute_heavy": COMPUTE_HEAVY}


def _op_name(op: Any) -> str:
    """``torch.ops.aten.mm`` -> ``"aten::mm"``, ``torch.ops.aten.mm.default`` ->
    ``"aten::mm.default"``; strings pass through."""
    if isinstance(op, str):
        if "::" in op:
            return op
        if "." not in op:  # "addmm": no namespace, so it would never match
            raise ValueError(
                f"seqckpt: a policy's op names must say their namespace, as "
                f"'aten::{op}' (or 'aten::{op}.default' for one overload), got {op!r}."
            )
        return op.replace(".", "::", 1)
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return str(op._qualified_op_name)
    raise TypeError(
        f"seqckpt: a policy's ops must be aten ops such as torch.ops.aten.mm or "
        f"torch.ops.aten.mm.default, got {op!r} ({type(op).__name__})."
    )


def ops(*selected: Any) -> Policy:
    """A policy keeping the outputs of the given aten ops.

    Example:
        >>> import torch
        >>> str(ops(torch.ops.aten.mm, torch.ops.aten.bmm.default))
        'keep(aten::bmm.default, aten::mm)'
    """
    # Every field given: dynamo 2.8 fails building a guard on a field's default
    # when the policy is made inside compiled code.
    kept = frozenset([_op_name(op) for op in selected])
    return Policy(ops=kept, names=frozenset(), label=None, keep=None)


def names(*selected: str) -> Policy:
    """A policy keeping the tensors marked with :func:`seqckpt.name` under one
    of these names.

    Example:
        >>> str(names("attn_out"))
        'keep(name:attn_out)'
    """
    for n in selected:
        if not isinstance(n, str) or not n:
            raise TypeError(f"seqckpt: names() takes non-empty strings, got {n!r}.")
    return Policy(names=frozenset(selected))


# where a caller meant ``policy=`` for the function (torch's checkpoint passes
# every keyword it does not know on to it)
_FOR_THE_FUNCTION = (
    " If it is an argument of the checkpointed function, bind it first: "
    "seqckpt.checkpoint(functools.partial(function, policy=...), x)."
)


def as_policy(policy: object) -> Policy | None:
    """Any accepted form of ``policy=`` as a :class:`Policy` (or None)."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        if policy in POLICIES:
            return POLICIES[policy]
        if "::" in policy:  # one op by name: "aten::mm"
            return ops(policy)
        raise ValueError(
            f"seqckpt: argument 'policy' must be None, {', '.join(map(repr, POLICIES))}, "
            f"an aten op or a collection of them, seqckpt.policies.names(...) or a "
            f"callable, got {policy!r}." + _FOR_THE_FUNCTION
        )
    if isinstance(policy, (torch.nn.Module, torch.Tensor)):
        # a module is callable and may be iterable: it would pass for a policy
        raise TypeError(
            "seqckpt: argument 'policy' is what a region keeps (None, "
            "'compute_heavy', aten ops, seqckpt.policies.names(...) or a callable "
            f"(op, *args, **kwargs) -> bool), got a {type(policy).__name__}."
            + _FOR_THE_FUNCTION
        )
    if isinstance(policy, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        # one op: a packet iterates over its overload names, an overload is
        # callable, and neither is meant as that
        return ops(policy)
    if isinstance(policy, Iterable):
        return ops(*policy)
    if callable(policy):
        label = getattr(policy, "__name__", None)
        keep = functools.partial(_in_forward, policy) if _takes_ctx(policy) else policy
        # every field given, as in ops()
        return Policy(
            ops=frozenset(), names=frozenset(), label=label, keep=keep, source=policy
        )
    raise TypeError(
        f"seqckpt: argument 'policy' must be None, 'compute_heavy', an aten op or "
        f"a collection of them, seqckpt.policies.names(...) or a callable, got "
        f"{policy!r}."
    )


# ---------------------------------------------------------------- the machinery


# An op's output is one tensor almost always; torch's tree_map (for tuples of
# them) is slower and leaves cyclic garbage behind on every call.
def _detached(out: Any) -> Any:
    if type(out) is torch.Tensor:
        return out.detach()
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _versions(out: Any) -> list[int]:
    return [t._version for t in _tensors(out)]


def _tensors(out: Any) -> list[torch.Tensor]:
    if type(out) is torch.Tensor:
        return [out]
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if isinstance(t, torch.Tensor) else None, out)
    return found


# Ops a policy never keeps nor serves (as in torch's selective checkpointing):
# they cost nothing to run again, and seqckpt's own hooks call ``detach`` in the
# recompute but not in the forward, so counting them would shift the call
# numbers that match a recompute's ops with the forward's.
IGNORED_OPS = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})
_TO_COPY = torch.ops.aten._to_copy.default


def uncounted_op(func: Any, args: Any) -> bool:
    """An op a policy neither numbers, keeps nor serves: one of
    :data:`IGNORED_OPS`, or a cast of a leaf tensor that requires grad (a
    weight under autocast). Autocast caches those casts, so whether one is run
    depends on the pass: a second forward in one autocast block takes them
    from the cache while its recompute runs them, and a backward inside the
    block is the other way round. Counted, they would shift every later op's
    place and nothing after them would be served."""
    if func in IGNORED_OPS:
        return True
    if func is _TO_COPY and args:
        t = args[0]
        return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad
    return False


# (generator, its state): the CPU generator's state tensor, or a CUDA
# generator's (seed, offset) (see _state.philox_state)
GeneratorStates = tuple[tuple[torch.Generator, Any], ...]
_SEEDED = torch.Tag.nondeterministic_seeded


def rng_after(func: Any, kwargs: dict[str, Any], out: Any) -> GeneratorStates | None:
    """For a random op (dropout, ``torch.rand``, attention that may apply
    dropout) that just ran: the state of every generator it may have drawn
    from, to be put in place where the recompute is served its output instead
    of running it. Without that, the random ops after it in the recompute
    would draw other numbers than in the forward (another dropout mask: wrong
    gradients, no error; torch's selective checkpointing does that). ``()``
    for an op that draws nothing; None where the generator cannot be read
    back (an accelerator other than CUDA): such an op is not kept."""
    if _SEEDED not in func.tags:
        return ()
    given = kwargs.get("generator")
    generators = [given] if given is not None else [torch.default_generator]
    if given is None:
        for t in _tensors(out):
            if t.device.type == "cuda":
                index = t.device.index
                generators.append(
                    torch.cuda.default_generators[
                        torch.cuda.current_device() if index is None else index
                    ]
                )
            elif t.device.type not in ("cpu", "meta"):
                return None
    unique = dict.fromkeys(generators)  # (each once, in order)
    if any(g.device.type not in ("cpu", "cuda") for g in unique):
        return None
    return tuple(
        (g, philox_state(g) if g.device.type == "cuda" else g.get_state())
        for g in unique
    )


def _put_rng(states: GeneratorStates, replayed: Collection[int]) -> None:
    """Put ``states`` in place for the generators among ``replayed`` (a
    generator the region does not replay, one reached through a global
    object's attribute, is left as the caller has it: the draw is served,
    nothing else changes)."""
    for g, state in states:
        if generator_key(g) not in replayed:
            continue
        if g.device.type == "cuda":
            put_philox_state(g, state)
        else:
            g.set_state(state)


class Kept:
    """What one region's forward kept: op outputs by (op, call number), with
    their versions so an output changed in place is never served, and the
    op's place among all the ops of the forward (see :class:`Serving`); for a
    kept op that draws random numbers, the state of the generators it may
    draw from right after it ran (see :func:`rng_after`)."""

    __slots__ = ("entries", "rng")

    def __init__(self) -> None:
        # (op, call number) -> (output, its versions, place among all ops)
        self.entries: dict[tuple[Any, int], tuple[Any, list[int], int]] = {}
        self.rng: dict[tuple[Any, int], GeneratorStates] = {}

    def forget_written(self, written: list[torch.Tensor]) -> None:
        """Drop the kept outputs whose memory an op just wrote into.

        A kept copy is made below autograd (inside the dispatch mode), where it
        does not share the version counter of the tensor the forward goes on
        with, so a later in-place op (``nn.SiLU(inplace=True)`` after a
        convolution) would leave it looking unchanged; the mode sees that op
        and drops the entry here instead, and the recompute runs the op again.
        """
        hit = storages_in(written).keys()
        for key in [
            key
            for key, (out, _, _) in self.entries.items()
            if not hit.isdisjoint(storages_in(out))
        ]:
            del self.entries[key]


class Keeping(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Active during a region's forward: keeps the outputs the policy selects."""

    counts_ops = True  # seqckpt's bookkeeping runs unseen by it (_state.unseen)

    def __init__(self, policy: Policy, kept: Kept) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.policy, self.kept = policy, kept
        self.calls: dict[Any, int] = {}
        self.place = 0  # ops seen so far
        self.labels: dict[tuple[Any, int], str] = {}  # kept by seqckpt.name
        # id -> (op, call number, place, the tensor, its version when the op
        # made it, the generators' states after it (see rng_after))
        self.by_tensor: dict[
            int,
            tuple[
                Any, int, int, weakref.ref[torch.Tensor], int, GeneratorStates | None
            ],
        ] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if uncounted_op(func, args):
            return out
        written = written_by(func, args, kwargs)
        if written and self.kept.entries:
            self.kept.forget_written(written)
        call = self.calls.get(func, 0)
        self.calls[func] = call + 1
        place = self.place
        self.place = place + 1
        if written:
            # An op that writes into a tensor (dropout's bernoulli_, an in-place
            # activation, batch norm in training) is never kept: serving its
            # output would skip the write, and later ops read the tensor it
            # writes, not its output.
            return out
        if self.policy.keeps(func, args, kwargs):
            rng = rng_after(func, kwargs, out)
            if rng is None:
                return out
            detached = _detached(out)
            self.kept.entries[(func, call)] = (detached, _versions(detached), place)
            if rng:
                self.kept.rng[(func, call)] = rng
        elif self.policy.names:
            rng = rng_after(func, kwargs, out)
            for t in _tensors(out):  # remembered in case it is named later
                self.by_tensor[id(t)] = (
                    func, call, place, weakref.ref(t), t._version, rng
                )  # fmt: skip
        return out

    def name(self, t: torch.Tensor, label: str) -> None:
        """``t`` was named ``label``, a name the policy keeps: keep the op that
        produced it, and when it is a view (a matmul's output reshaped), the op
        that produced its base too, so that op is not run again either. A
        tensor written in place since its op made it (``r = gelu(h);
        r.mul_(2)``) holds other values than that op's output, so it is not
        kept: the recompute runs the op and the write again."""
        for tensor in (t, t._base):
            if tensor is None:
                continue
            found = self.by_tensor.get(id(tensor))
            if found is None:
                continue
            func, call, place, ref, version, rng = found
            if ref() is tensor and tensor._version == version and rng is not None:
                detached = tensor.detach()
                self.kept.entries[(func, call)] = (detached, [version], place)
                if rng:
                    self.kept.rng[(func, call)] = rng
                self.labels[(func, call)] = label


class Serving(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Active during a recompute: serves kept outputs instead of running ops.
    With ``consume`` each output leaves the cache as it is served, so one the
    recomputed graph does not save is freed when its consumers are done (as
    in the forward), not held to the end of the recompute.

    An output is served only where its op also holds the same place among all
    the ops as in the forward: code that runs in the forward only (a hook
    behind ``if not seqckpt.is_recomputing():`` computing a statistic) shifts
    the call numbers of the ops it runs, and the recompute would otherwise be
    served that code's output in place of the model's. From such a shift on,
    the recompute runs the ops instead."""

    counts_ops = True

    def __init__(
        self, kept: Kept, consume: bool = True, replayed: Collection[int] = ()
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept = kept
        self.consume = consume
        # the generators the region replays (and gives the caller back after
        # the recompute), by their C++ object: only those are moved on for a
        # served draw
        self.replayed = replayed
        self.calls: dict[Any, int] = {}
        self.place = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if uncounted_op(func, args):
            return func(*args, **(kwargs or {}))
        call = self.calls.get(func, 0)
        self.calls[func] = call + 1
        place = self.place
        self.place = place + 1
        entries = self.kept.entries
        entry = (
            entries.pop((func, call), None)
            if self.consume
            else entries.get((func, call))
        )
        if entry is not None:
            out, versions, kept_at = entry
            if kept_at == place and _versions(out) == versions:
                take = self.kept.rng.pop if self.consume else self.kept.rng.get
                rng = take((func, call), None)
                if rng is not None:  # as if it had drawn its numbers again
                    _put_rng(rng, self.replayed)
                # Left in the cache (a recompute inside the forward), it is
                # served again later: hand out an alias, as autograd makes a
                # served view op's output a view of its base (metadata it
                # refuses to attach twice to one tensor).
                return out if self.consume else _detached(out)
        return func(*args, **(kwargs or {}))


# The forwards of regions with a names policy now running, innermost last; per
# thread (DataParallel runs replicas in threads), as a context variable.
_NAMING: contextvars.ContextVar[tuple[tuple[Keeping, frozenset[str]], ...]] = (
    contextvars.ContextVar("seqckpt_naming", default=())
)


@contextlib.contextmanager
def naming(keeping: Keeping, names: frozenset[str]) -> Iterator[None]:
    """While a region with a names policy runs its forward: :func:`name` calls
    with one of ``names`` go to ``keeping``."""
    token = _NAMING.set((*_NAMING.get(), (keeping, names)))
    try:
        yield
    finally:
        _NAMING.reset(token)


def name(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """Mark ``tensor`` with a name a :func:`names` policy can keep; returns the
    tensor itself. Outside a region whose policy keeps this name it does
    nothing. Under ``torch.compile`` a name that a names policy keeps becomes
    an op of the graph (``seqckpt::named``, a copy of the tensor) that torch's
    selective checkpointing is told to save, so the op that produced it is not
    recomputed there either.

    Example:
        >>> import torch, seqckpt
        >>> def block(x):
        ...     h = seqckpt.name(x @ x.T, "scores")  # kept: not recomputed
        ...     return h.softmax(-1) @ x
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> policy = seqckpt.policies.names("scores")
        >>> seqckpt.checkpoint(block, x, policy=policy).sum().backward()
    """
    if not isinstance(label, str) or not label:
        raise TypeError(
            f"seqckpt: name() takes a non-empty string label, got {label!r}."
        )
    if not isinstance(tensor, torch.Tensor):
        # (a tuple an attention module returns, say: it would be named silently
        # not at all, and nothing kept)
        raise TypeError(
            f"seqckpt: name() takes a tensor, got {type(tensor).__name__}; name "
            "the tensor to keep, e.g. seqckpt.name(out[0], label)."
        )
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the lookup below. A name some names policy keeps
        # becomes seqckpt::named in the graph, whose output torch's selective
        # checkpointing saves (see _keeps); other names cost nothing.
        if label in _POLICY_NAMES:
            return _NAME_OP(tensor, label)  # type: ignore[no-any-return]
        return tensor
    for keeping, wanted in reversed(_NAMING.get()):
        if label in wanted:
            keeping.name(tensor, label)
            break
    return tensor
