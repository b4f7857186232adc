"""Profiling a chain for the planner: time and memory of each item, measured in a
sandbox that leaves the user's model and RNG as they were.

Example:
    >>> import torch, seqckpt
    >>> chain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> prof = seqckpt.profile(chain, torch.randn(4, 8), repeats=1)
    >>> len(prof), prof.layers[1].output_bytes
    (2, 128)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from seqckpt._buffers import modules_of, watching_modules
from seqckpt._chain import as_chain
from seqckpt._options import Options
from seqckpt._region import _Region
from seqckpt._state import (
    RngState,
    _any_autocast,
    accelerator_devices,
    generators_held,
    unseen,
)
from seqckpt._tree import replace_tensors, storages_in, tensors_in
from seqckpt.memory import MemoryStats, Stopwatch, track_memory
from seqckpt.planner.twins import twin_key
from seqckpt.policies import Policy, as_policy

__all__ = ["ChainProfile", "LayerProfile", "PolicyCost", "profile"]


@dataclass(frozen=True)
class LayerProfile:
    """What one item of the chain costs.

    Attributes:
        name: a short description of the item.
        forward_time: median seconds of its forward with grad.
        backward_time: median seconds of its backward.
        input_bytes: bytes of the tensors it receives.
        output_bytes: bytes of the tensors it returns.
        saved_bytes: bytes alive after its forward with grad: what autograd keeps
            plus the output (its input, held by whoever made it, is not).
        held_bytes: of those, what is still held when its backward starts: what
            autograd keeps, so the output only if the item saved it (tanh does,
            a linear layer does not); for the chain's last item, its output
            too (the caller holds it through backward).
        forward_peak_bytes: the most bytes its forward with grad allocates at once.
        nograd_peak_bytes: the same for a forward that keeps nothing for backward.
        backward_peak_bytes: the most bytes its backward holds at once beyond
            ``held_bytes``: the output gradient, temporaries and the input
            gradient (saved tensors freed on the way count against it).
        region_kept_bytes: bytes a checkpointed forward of the item (no
            policy) leaves alive besides its input and output until its
            recompute: under ``torch.autocast`` with its cache on (the
            default), the low-precision copy of every weight it casts (held by
            autocast's cache until the autocast block ends, whatever a region
            drops), the buffer copies the region keeps to replay, and tensors a
            module stores on itself (not the CPU generator's 5 KB state a
            region keeps: the tracker sees only the outputs of ops).
        region_cast_bytes: of ``region_kept_bytes``, what autocast's cache
            holds: freed when the autocast block ends, which in torch's
            mixed-precision recipe is before backward (and inside a recompute,
            when that recompute ends), so the cost model charges it through
            the forward only.
        input_held: something still holds its input after its forward, while
            its graph lives: its graph saved it (a linear layer, for the weight
            gradient), its output is a view of it, or a module stores it.
        output_held: its output stays alive after its forward once nothing
            else holds it (its graph saved it: ``tanh``, ``relu``). Where
            neither this item holds its output nor the next its input (a linear
            layer before a ReLU or dropout; a frozen layer before another), the
            cost model frees the output after the next item's forward.
        modifies_input: it writes into its input in place (``nn.ReLU(inplace=
            True)``); a checkpointed stretch never starts at such an item.
        returns_input: its output is (a view of) its input; where it does not
            hold it (``output_held`` False), the cost model looks through it to
            the next item to tell whether the storage lives on.
        policies: for each policy the chain was profiled with (see
            :func:`profile`), what the item keeps under it and the seconds of
            its recompute.
        shared_grad_bytes: what the backward holds besides, while this item's
            backward (or a recompute ending at it) runs, for parameters it or
            an item before it shares with an item after it (a block applied
            several times: ALBERT, looped transformers). Autograd sums such a
            parameter's gradient over its uses before accumulating it into
            ``.grad``: the sum is held from the backward of the last use to
            that of the first, and each use adds its contribution out of
            place. 0 where no parameter is shared (see
            :func:`shared_grad_bytes`).
    """

    name: str
    forward_time: float
    backward_time: float
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    held_bytes: int
    forward_peak_bytes: int
    nograd_peak_bytes: int
    backward_peak_bytes: int
    region_kept_bytes: int = 0
    region_cast_bytes: int = 0
    input_held: bool = True
    output_held: bool = True
    modifies_input: bool = False
    returns_input: bool = False
    policies: tuple[PolicyCost, ...] = ()
    shared_grad_bytes: int = 0

    def forward_time_under(self, cost: PolicyCost) -> float:
        """Seconds of its checkpointed forward under ``cost``'s policy."""
        return self.forward_time if cost.forward_time is None else cost.forward_time


@dataclass(frozen=True)
class PolicyCost:
    """What one item costs checkpointed under one policy.

    Attributes:
        policy: the policy.
        kept_bytes: bytes the forward keeps, the item's output included when
            the policy keeps it (a Linear's output under ``compute_heavy``).
        recompute_time: seconds of its recompute (the kept results served, the
            rest run again).
        keeps_output: the policy keeps the item's output: inside a stretch it
            is kept like any other result; at the stretch's end it is the
            stretch's output, which is held anyway.
        forward_time: seconds of its checkpointed forward under the policy
            (choosing what to keep costs time on every op); None in profiles
            written before it was measured, read as the plain forward's time.
        cast_bytes: of ``kept_bytes``, what autocast's cache holds (see
            :attr:`LayerProfile.region_cast_bytes`).
    """

    policy: Policy
    kept_bytes: int
    recompute_time: float
    keeps_output: bool = False
    forward_time: float | None = None
    cast_bytes: int = 0


@dataclass(frozen=True)
class ChainProfile:
    """The profile of every item of a chain, in order, on one device."""

    layers: tuple[LayerProfile, ...]
    device: str

    def __len__(self) -> int:
        return len(self.layers)

    def table(self) -> str:
        """The profile as an aligned text table, one row per item."""
        head: tuple[str, ...] = ("#", "item", "fwd ms", "bwd ms", "in MiB",
                "out MiB", "saved MiB", "fwd peak MiB", "bwd peak MiB",
                "ckpt kept MiB", "of which casts MiB")  # fmt: skip
        for policy in self.policies:
            head += (
                f"{policy} kept MiB",
                f"{policy} fwd ms",
                f"{policy} recompute ms",
            )
        rows = [head]
        for i, p in enumerate(self.layers):
            rows.append(
                (
                    str(i),
                    p.name,
                    f"{p.forward_time * 1e3:.3f}",
                    f"{p.backward_time * 1e3:.3f}",
                    f"{p.input_bytes / 2**20:.3f}",
                    f"{p.output_bytes / 2**20:.3f}",
                    f"{p.saved_bytes / 2**20:.3f}",
                    f"{p.forward_peak_bytes / 2**20:.3f}",
                    f"{p.backward_peak_bytes / 2**20:.3f}",
                    f"{p.region_kept_bytes / 2**20:.3f}",
                    f"{p.region_cast_bytes / 2**20:.3f}",
                    *(
                        value
                        for c in p.policies
                        for value in (
                            f"{c.kept_bytes / 2**20:.3f}",
                            f"{p.forward_time_under(c) * 1e3:.3f}",
                            f"{c.recompute_time * 1e3:.3f}",
                        )
                    ),
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        text = "\n".join(
            "  ".join(
                v.rjust(w) if c != 1 else v.ljust(w)
                for c, (v, w) in enumerate(zip(r, widths, strict=True))
            )  # fmt: skip
            for r in rows
        )
        shared = max((p.shared_grad_bytes for p in self.layers), default=0)
        if shared:
            text += (
                "\ngradients of parameters shared by items, summed during "
                f"backward: up to {shared / 2**20:.3f} MiB"
            )
        return text

    @property
    def policies(self) -> tuple[Policy, ...]:
        """The policies every item was measured under (besides None)."""
        return tuple(c.policy for c in self.layers[0].policies) if self.layers else ()

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain data (:meth:`from_dict` reads it back; a callable
        policy is written as its name and cannot be read back)."""
        layers = []
        for p in self.layers:
            row = asdict(p)
            row["policies"] = [
                {
                    "policy": c.policy.to_json()
                    if c.policy.keep is None
                    else str(c.policy),
                    "kept_bytes": c.kept_bytes,
                    "recompute_time": c.recompute_time,
                    "keeps_output": c.keeps_output,
                    "forward_time": c.forward_time,
                    "cast_bytes": c.cast_bytes,
                }
                for c in p.policies
            ]
            layers.append(row)
        return {"device": self.device, "layers": layers}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ChainProfile:
        """Read what :meth:`to_dict` wrote."""
        layers = []
        for row in data["layers"]:
            fields = {k: v for k, v in row.items() if k != "policies"}
            costs = tuple(
                PolicyCost(
                    Policy.from_json(c["policy"]),
                    int(c["kept_bytes"]),
                    float(c["recompute_time"]),
                    bool(c.get("keeps_output", False)),
                    None if c.get("forward_time") is None else float(c["forward_time"]),
                    int(c.get("cast_bytes", 0)),
                )
                for c in row.get("policies", ())
            )
            layers.append(LayerProfile(**fields, policies=costs))
        return ChainProfile(tuple(layers), str(data["device"]))


def _nbytes(obj: Any) -> int:
    return sum(storages_in(obj).values())


def _detached(obj: Any, requires_grad: Sequence[bool]) -> Any:
    tensors = tensors_in(obj)
    return replace_tensors(
        obj,
        [
            t.detach().requires_grad_(flag)
            for t, flag in zip(tensors, requires_grad, strict=True)
        ],
    )


def _device(obj: Any, chain: Sequence[Callable[..., Any]]) -> torch.device:
    for t in tensors_in(obj):
        return t.device
    for item in chain:
        if isinstance(item, nn.Module):
            for p in item.parameters():
                return p.device
    return torch.device("cpu")


class _Sandbox:
    """What profiling changes, recorded as modules are first called (however the
    chain reaches them) and put back at the end: buffers (e.g. BatchNorm
    statistics), ``.grad`` s, training flags and the state of the
    ``torch.Generator`` objects modules hold. Parameters are not written by a
    forward and backward, so they are left alone. Inside, parameter gradients
    are zero tensors (as in a training loop that keeps them allocated)."""

    def __init__(self) -> None:
        self.visited: set[int] = set()
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self.flags: list[tuple[nn.Module, bool]] = []
        self.params: set[int] = set()
        self.generators: list[torch.Generator] = []
        self.rng: list[tuple[torch.Generator, torch.Tensor]] = []

    def seen(self, module: nn.Module) -> None:
        for sub in module.modules():
            if id(sub) in self.visited:
                continue
            self.visited.add(id(sub))
            self.flags.append((sub, sub.training))
            known = len(self.generators)
            generators_held(sub.__dict__.values(), self.generators)
            self.rng += [(g, g.get_state()) for g in self.generators[known:]]
            for b in sub.buffers(recurse=False):
                self.buffers.append((b, b.detach().clone()))
            for p in sub.parameters(recurse=False):
                if id(p) in self.params or not p.is_leaf:
                    # (a deep copy of a TorchScript module holds clones with a
                    # history, whose .grad autograd never fills)
                    continue
                self.params.add(id(p))
                self.grads.append((p, p.grad))
                p.grad = torch.zeros_like(p) if p.requires_grad else None

    def restore(self) -> None:
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)
        for p, grad in self.grads:
            p.grad = grad
        for sub, flag in self.flags:
            sub.training = flag
        for g, state in self.rng:
            g.set_state(state)


@contextmanager
def sandbox(devices: tuple[torch.device, ...]) -> Iterator[_Sandbox]:
    """Run the block, then put back what it changed in the modules it called
    (see :class:`_Sandbox`) and the global RNG state. Its copies of what it
    puts back are made unseen by a policy's modes (they number ops)."""
    box = _Sandbox()
    rng = RngState.capture(devices)
    try:
        with watching_modules(partial(unseen, box.seen)):
            yield box
    finally:
        box.restore()
        rng.restore()


class _OnesGrad(torch.autograd.Function):
    """Identity whose backward makes the output gradient (ones) inside the engine,
    so it is allocated when backward starts and freed as soon as it is used, as
    a real loss (cross-entropy, MSE) does. ``out.sum().backward()`` would hand
    backward a zero-byte expanded scalar, and ``out.backward(g)`` keeps ``g``
    alive throughout."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(grad, memory_format=torch.contiguous_format)


def _roots(out: Any) -> list[torch.Tensor]:
    apply: Callable[[torch.Tensor], torch.Tensor] = _OnesGrad.apply  # type: ignore[assignment]
    return [apply(t).sum() for t in tensors_in(out) if t.requires_grad]


def backward_with_loss_grad(out: Any) -> None:
    """Backward from every tensor in ``out`` that requires grad, with an output
    gradient of ones made the way a real loss makes it (see ``_OnesGrad``). The
    profile, the frontier measurement and the benchmarks all use it, so they
    measure the same step."""
    roots = _roots(out)
    if roots:
        torch.autograd.backward(roots)


def _clear_input_grads(x: Any) -> None:
    for t in tensors_in(x):
        t.grad = None


def _leave_autocast_cache() -> None:
    """Empty autocast's cache of cast weights, as leaving the autocast block
    does (see :func:`_fresh`)."""
    if _any_autocast() and torch.is_autocast_cache_enabled():
        torch.clear_autocast_cache()  # type: ignore[no-untyped-call]


def _fresh(x: Any) -> Any:
    """A copy of the item's input that it may modify in place (non-leaf copies
    of tensors that require grad: their gradient still reaches ``x``), made
    just before a measured run, with autocast's cache of cast weights emptied:
    in a training step each weight is cast inside the step and its
    low-precision copy held until backward, so a run that found the casts of
    an earlier run cached would leave them out (torchvision's mobilenet_v2
    under bf16 autocast: 16.13 MiB predicted, 19.56 measured)."""
    _leave_autocast_cache()
    return replace_tensors(x, [t.clone() for t in tensors_in(x)])


def _storages(obj: Any) -> set[int]:
    return set(storages_in(obj))


def _name(item: Callable[..., Any]) -> str:
    if isinstance(item, nn.Module):
        return type(item).__name__
    return getattr(item, "__name__", type(item).__name__)


def _profile_item(
    item: Callable[..., Any],
    x: Any,
    device: torch.device,
    repeats: int,
    policies: Sequence[Policy],
    box: _Sandbox,
    last: bool = False,
) -> tuple[LayerProfile, Any, list[torch.Tensor]]:
    # Warm up outside the measurements: the sandbox meets the modules the item
    # calls (and gives their parameters zero gradients), and on CUDA the first
    # cuBLAS / cuDNN calls allocate workspaces, forward and backward.
    if device.type == "cuda":
        backward_with_loss_grad(item(_fresh(x)))
        _clear_input_grads(x)
    elif isinstance(item, nn.Module):
        box.seen(item)
    nograd = _nograd_forward(item, x, device, box)
    inputs = _fresh(x)
    versions = [t._version for t in tensors_in(inputs)]
    with track_memory(device) as mem:
        out = item(inputs)
        forward_peak = mem.peak_so_far()
        saved = mem.live_bytes()
        output_bytes = _nbytes(out)
        modifies_input = versions != [t._version for t in tensors_in(inputs)]
        returns_input = bool(_storages(out) & _storages(inputs))
        del inputs
        roots = _roots(out)
        # In a chain nothing holds an item's output but what saved it; the
        # last item's, the chain's output, its caller holds through backward
        # (freed with what saved it, a final ReLU's result went uncounted
        # from that ReLU's backward on: resnet50's trunk 64 KiB above its
        # predicted peak).
        caller_holds = out if last else None
        del out
        _leave_autocast_cache()  # backward runs after the autocast block
        held = mem.live_bytes()
        mem.reset_peak()
        if roots:
            torch.autograd.backward(roots)
        del roots, caller_holds
        # Saved tensors freed during backward count against its peak.
        backward_peak = max(0, mem.peak_so_far() - held)
    _clear_input_grads(x)

    forwards, backwards = Stopwatch(device), Stopwatch(device)
    for _ in range(repeats):
        out = forwards.run(partial(item, _fresh(x)))
        backwards.run(partial(backward_with_loss_grad, out))
        _clear_input_grads(x)
    forward_time = statistics.median(forwards.seconds())
    input_held, output_held = _what_stays(item, x, device)
    # An item that writes into its input cannot be a region by itself; it is
    # charged as recomputed in full, keeping nothing.
    region_kept, _, region_cast = (
        (0, False, 0)
        if modifies_input
        else _region_kept(item, x, device, None, output_bytes)
    )
    costs = tuple(
        PolicyCost(policy, 0, forward_time, forward_time=forward_time)
        if modifies_input
        else _policy_cost(item, x, device, policy, output_bytes, repeats)
        for policy in policies
    )
    next_input = _detached(out, [t.requires_grad for t in tensors_in(out)])
    used = _leaves_reached(out, x)
    del out
    layer = LayerProfile(
        name=_name(item),
        forward_time=forward_time,
        backward_time=statistics.median(backwards.seconds()),
        input_bytes=_nbytes(x),
        output_bytes=output_bytes,
        saved_bytes=saved,
        held_bytes=held,
        forward_peak_bytes=forward_peak,
        nograd_peak_bytes=nograd.peak_bytes,
        backward_peak_bytes=backward_peak,
        region_kept_bytes=region_kept,
        region_cast_bytes=region_cast,
        input_held=input_held,
        output_held=output_held,
        modifies_input=modifies_input,
        returns_input=returns_input,
        policies=costs,
    )
    return layer, next_input, used


def _leaves_reached(out: Any, x: Any) -> list[torch.Tensor]:
    """The tensors requiring grad that ``out``'s graph accumulates gradients
    into (the parameters the item used), its input ``x`` left out: a walk
    over the graph's nodes (still there after its backward)."""
    inputs = set(map(id, tensors_in(x)))
    found: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    pending: list[Any] = [t.grad_fn for t in tensors_in(out)]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor) and id(leaf) not in inputs:
            found[id(leaf)] = leaf
        pending.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def _what_stays(
    item: Callable[..., Any], x: Any, device: torch.device
) -> tuple[bool, bool]:
    """Whether the item's input, and its output, stay alive after its forward
    with grad while its graph does, once the caller lets go of them (see
    :attr:`LayerProfile.input_held`): measured by the bytes that dropping
    each frees."""
    with track_memory(device) as mem:
        inputs = _fresh(x)
        input_bytes = _nbytes(inputs)
        out = item(inputs)
        output_bytes = _nbytes(out)
        roots = _roots(out)  # the graph, as the rest of the chain holds it
        before = mem.live_bytes()
        del inputs
        after_input = mem.live_bytes()
        del out
        after_output = mem.live_bytes()
        del roots
    _clear_input_grads(x)
    return (
        before - after_input < input_bytes,
        after_input - after_output < output_bytes,
    )


def _nograd_forward(
    item: Callable[..., Any], x: Any, device: torch.device, box: _Sandbox
) -> MemoryStats:
    """A forward without grad, tracked. On the CPU it is the warm-up too
    (only the first call of a module differs there): where it met modules
    the sandbox had not seen or left tensors alive beyond its output (a
    cache a module fills on its first call), it runs and is measured again."""
    for again in (False, True):
        inputs = _fresh(x)
        met = len(box.visited)
        with torch.no_grad(), track_memory(device) as stats:
            item(inputs)
            left = stats.live_bytes()
        if again or device.type == "cuda" or (left == 0 and len(box.visited) == met):
            break
    return stats


def _region_kept(
    item: Callable[..., Any],
    x: Any,
    device: torch.device,
    policy: Policy | None,
    output_bytes: int,
) -> tuple[int, bool, int]:
    """What ``item`` checkpointed under ``policy`` (None: no policy) leaves
    alive after its forward until its recompute: the live bytes then, less
    its output unless the policy keeps that; whether it does; and how much of
    it autocast's cache holds (the casts of the weights the item uses, freed
    when the autocast block ends). Besides what a policy keeps and those
    casts, it is the buffer copies the region keeps to replay and tensors a
    module stores on itself."""
    options = Options(early_stop=False, policy=policy)
    inputs = _fresh(x)  # made outside the tracker: the caller holds it
    with track_memory(device) as mem:
        region = _Region(item, (inputs,), {}, options, None)
        out = region.run()
        keeps_output = False
        if region.kept is not None:
            kept_storages = _storages([t for t, _, _ in region.kept.entries.values()])
            keeps_output = bool(_storages(out)) and _storages(out) <= kept_storages
        kept = mem.live_bytes() if keeps_output else mem.live_bytes() - output_bytes
        before = mem.live_bytes()
        _leave_autocast_cache()
        cast = before - mem.live_bytes()
    del inputs, out, region
    return max(0, kept), keeps_output, max(0, min(cast, kept))


def _policy_cost(
    item: Callable[..., Any],
    x: Any,
    device: torch.device,
    policy: Policy,
    output_bytes: int,
    repeats: int,
) -> PolicyCost:
    """What ``item`` keeps when checkpointed under ``policy`` (see
    :func:`_region_kept`), and the median seconds of that forward and of its
    recompute alone (run to its end, as inside a longer stretch)."""
    options = Options(early_stop=False, policy=policy)
    kept, keeps_output, cast = _region_kept(item, x, device, policy, output_bytes)
    forwards, recomputes = Stopwatch(device), Stopwatch(device)
    for _ in range(repeats):  # timed outside the tracker
        region = _Region(item, (_fresh(x),), {}, options, None)
        out = forwards.run(region.run)
        recomputes.run(region._recompute)
        del out, region
    return PolicyCost(
        policy,
        kept,
        statistics.median(recomputes.seconds()),
        keeps_output,
        statistics.median(forwards.seconds()),
        cast,
    )


def _check_initialized(chain: Sequence[Callable[..., Any]]) -> None:
    for index, item in enumerate(chain):
        if isinstance(item, nn.Module) and any(is_lazy(p) for p in item.parameters()):
            raise ValueError(
                f"seqckpt: item {index} of the chain ({_name(item)}) has lazy "
                "parameters that are not initialized yet (nn.LazyLinear and the "
                "like); run one forward through the model first, e.g. "
                "model(sample), then profile or plan it."
            )


def _candidates(policies: Sequence[Any]) -> list[Policy]:
    """The distinct policies other than None, in order."""
    if isinstance(policies, (str, Policy)) or not isinstance(policies, Sequence):
        raise TypeError(
            "seqckpt: argument 'policies' must be a list or tuple of policies, "
            f"e.g. (None, 'compute_heavy'), got {policies!r}."
        )
    found: list[Policy] = []
    for p in policies:
        resolved = as_policy(p)
        if resolved is not None and resolved not in found:
            found.append(resolved)
    return found


def profile(
    modules: Any,
    sample_input: Any,
    *,
    repeats: int = 5,
    policies: Sequence[Any] = (),
    twins: bool = True,
) -> ChainProfile:
    """Measure each item of a chain: forward and backward time (medians of
    ``repeats`` runs, after the runs that measure memory; on CUDA timed with
    events, so small items are not charged launch latency), input and output
    bytes, the bytes autograd keeps, what a checkpointed forward of the item
    still leaves alive (under ``torch.autocast``, the weight casts its cache
    holds), and the transient peaks of forward and backward (measured after a
    warm-up, on CUDA a forward and backward of the
    item, so workspaces that the first cuBLAS or cuDNN call allocates are not
    charged to it).

    Each item runs on a detached copy of the previous item's output, so items are
    measured one at a time. An item that is a twin of one measured before (the
    same module structure and attributes with an input of the same shapes, see
    :mod:`seqckpt.planner.twins`: the blocks of a transformer) is not measured
    again, nor run: it gets its twin's figures, and its twin's output (of the
    same shapes) is the next item's input. The chain's last item is always
    measured, its output held through its backward as the chain's caller
    holds it. The chain is sandboxed: its parameters, buffers (e.g.
    BatchNorm statistics), ``.grad`` s, training flags and the global RNG state are
    the same afterwards as before.

    Args:
        modules: the chain, in any form :func:`seqckpt.checkpoint_sequential` takes.
        sample_input: an input batch like the ones the chain will train on.
        repeats: timed runs per item.
        policies: policies (other than None) to measure each item under, for
            :func:`seqckpt.plan` to choose among: what the item keeps under each
            and the time of its recompute (see :mod:`seqckpt.policies`).
        twins: give twins of a measured item its figures (and its output as
            the next item's input) instead of measuring and running them.
            False measures every item: for blocks whose cost or output shape
            depends on the values they see (mixture-of-experts routing, token
            dropping), or to see each item's own timing.

    Returns:
        A :class:`ChainProfile`; pass it to :func:`seqckpt.plan`.

    Example:
        >>> import torch, seqckpt
        >>> chain = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        >>> prof = seqckpt.profile(chain, torch.randn(32, 64), repeats=2)
        >>> [p.output_bytes for p in prof.layers]
        [8192, 8192, 8192]
    """
    chain = as_chain(modules)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"seqckpt: repeats must be an int >= 1, got {repeats!r}.")
    chosen = _candidates(policies)
    _check_initialized(chain)
    device = _device(sample_input, chain)
    devices = accelerator_devices(tensors_in(sample_input))
    layers = []
    # An item's twin measured earlier: its figures and its (detached) output,
    # which stands in for the twin's own as the next item's input.
    measured: dict[Hashable, tuple[LayerProfile, Any, Any, list[torch.Tensor]]] = {}
    # the parameters each item accumulates gradients into
    used: list[list[torch.Tensor]] = []
    with sandbox(devices) as box, torch.enable_grad():
        x = _detached(sample_input, [t.requires_grad for t in tensors_in(sample_input)])
        for index, item in enumerate(chain):
            last = index == len(chain) - 1  # measured with its output held
            key = twin_key(item, x) if twins and not last else None
            twin = measured.get(key) if key is not None else None
            if twin is not None:
                layers.append(replace(twin[0], name=_name(item)))
                x = twin[1]
                # the same object uses the same parameters; another its own
                used.append(
                    twin[3]
                    if twin[2] is item
                    else [p for p in chain_parameters([item]) if p.requires_grad]
                )
                continue
            layer, x, reached = _profile_item(
                item, x, device, repeats, chosen, box, last
            )
            layers.append(layer)
            used.append(reached)
            if key is not None:
                measured[key] = (layer, x, item, reached)
    shared = shared_grad_bytes(used)
    return ChainProfile(
        tuple(
            replace(layer, shared_grad_bytes=b) if b else layer
            for layer, b in zip(layers, shared, strict=True)
        ),
        str(device),
    )


def chain_modules(chain: Sequence[Any]) -> list[nn.Module]:
    """The modules the chain's items run, with their submodules, each once."""
    found = {
        id(m): m for item in chain for top in modules_of(item) for m in top.modules()
    }
    return list(found.values())


def parameters_of(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The parameters of ``modules`` (their own, not their submodules'), each
    once."""
    params = {id(p): p for m in modules for p in m.parameters(recurse=False)}
    return list(params.values())


def chain_parameters(chain: Sequence[Any]) -> list[torch.Tensor]:
    """The parameters of the modules the chain's items run, each once."""
    return parameters_of(chain_modules(chain))


def shared_grad_bytes(used: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """Given the parameters each item of a chain uses, the bytes of gradient
    sums the backward holds for shared ones while each item's backward runs
    (see :attr:`LayerProfile.shared_grad_bytes`): a parameter used by items
    ``lo`` to ``hi`` counts at items ``lo`` to ``hi - 1`` (its sum, made at
    ``hi``'s backward and accumulated into ``.grad`` after ``lo``'s), and
    at each of those that uses one, the largest such parameter's once more
    (the new sum a contribution makes beside the old one, one parameter at a
    time).

    Example:
        >>> from torch import nn
        >>> block = nn.Linear(100, 100)  # weight 40,000 bytes, bias 400
        >>> uses = list(block.parameters())
        >>> shared_grad_bytes([uses, [], uses])
        [80400, 40400, 0]
        >>> shared_grad_bytes([list(nn.Linear(100, 100).parameters()) for _ in range(2)])
        [0, 0]
    """
    users: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, params in enumerate(used):
        for p in {id(p): p for p in params}.values():
            users.setdefault(id(p), (p, []))[1].append(i)
    held = [0] * len(used)
    adding = [0] * len(used)
    for p, items in users.values():
        for i in range(items[0], items[-1]):
            held[i] += p.nbytes
        for i in items[:-1]:
            adding[i] = max(adding[i], p.nbytes)
    return [h + a for h, a in zip(held, adding, strict=True)]
