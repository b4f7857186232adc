"""Checkpointing a chain: :func:`checkpoint_sequential` and the drop-in
:class:`CheckpointedSequential`.

``segments`` in every form (a count, a list of sizes, a :class:`~seqckpt.planner.Plan`,
``"auto"``) becomes a plan (:func:`run_segments`), and
:func:`seqckpt.executor.run_plan` runs it with the one primitive. No strategy is
special-cased in the executor.
"""

from __future__ import annotations

import contextvars
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from seqckpt._chain import Chain, as_chain
from seqckpt._options import ContextFn, DeterminismCheck, Options, make_options
from seqckpt.executor import resolve_plan, run_plan
from seqckpt.planner.adaptive import BudgetSource
from seqckpt.planner.budget import parse_budget
from seqckpt.planner.planning import auto_step
from seqckpt.planner.tree import Plan, default_segments
from seqckpt.policies import Policy, as_policy

__all__ = ["CheckpointedSequential", "checkpoint_sequential"]

Segments = int | Sequence[int] | Plan | str

# The CheckpointedSequential modules whose training forward runs now (on this
# thread): their blocks, which checkpoint_blocks also gives a forward that
# checkpoints them one by one where a parent loops over the stack instead of
# calling it, run plainly when the stack itself calls them.
_RUNNING: contextvars.ContextVar[tuple[nn.Module, ...]] = contextvars.ContextVar(
    "seqckpt_running_stacks", default=()
)


def called_by_its_stack(block: nn.Module) -> bool:
    """Whether ``block`` runs now as part of a CheckpointedSequential's own
    forward (not called by a parent looping over the stack's blocks)."""
    return any(
        any(m is block for m in stack._modules.values()) for stack in _RUNNING.get()
    )


def run_segments(
    segments: object,
    chain: Sequence[Callable[[Any], Any]],
    input: Any,
    memory_budget: BudgetSource | None,
    policy: Policy | None,
    options: Options,
) -> Any:
    """Run ``chain`` on ``input`` checkpointed as ``segments`` says, in any
    accepted form; ``"auto"`` asks the planner for each batch (see
    :func:`seqckpt.planner.planning.auto_step`)."""
    if segments == "auto":
        _check_no_policy_with_auto(policy)
        return auto_step(
            chain,
            input,
            memory_budget,
            lambda plan: run_plan(plan, chain, input, options),
        )
    _check_budget_use(segments, memory_budget)
    return run_plan(resolve_plan(segments, chain, policy), chain, input, options)


def _check_no_policy_with_auto(policy: Policy | None) -> None:
    if policy is not None:
        raise ValueError(
            f"seqckpt: policy={policy} was given with segments='auto', where the "
            "planner chooses each stretch's policy; plan with "
            "seqckpt.plan(..., policies=...) to choose the candidates."
        )


def _check_budget_use(segments: object, memory_budget: object) -> None:
    if memory_budget is not None and segments != "auto":
        raise ValueError(
            f"seqckpt: memory_budget={memory_budget!r} is only used with "
            f"segments='auto', got segments={segments!r}; pass segments='auto' or "
            "plan with seqckpt.plan(..., memory_budget=...)."
        )


def checkpoint_sequential(
    functions: Chain,
    segments: Segments,
    input: Any,
    use_reentrant: bool | None = None,
    *,
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = "default",
    context_fn: ContextFn | None = None,
    debug: bool = False,
    early_stop: bool = True,
    memory_budget: BudgetSource | None = None,
    policy: Any = None,
    respect_saved_tensors_hooks: bool | None = None,
) -> Any:
    """Run a chain of modules with all but its last segment checkpointed.

    Takes the arguments of ``torch.utils.checkpoint.checkpoint_sequential``,
    named and placed as torch's (``use_reentrant`` is accepted and ignored, as
    in :func:`seqckpt.checkpoint`).

    Args:
        functions: the chain: an ``nn.Sequential``, ``nn.ModuleList``, or a
            list or tuple of modules or plain callables. A nested
            ``nn.Sequential`` is one item.
        segments: an int ``k`` (1 <= k <= number of modules): ``k`` contiguous
            segments whose sizes differ by at most one, smaller ones first (torch
            puts the whole remainder in its last, plain segment), none starting
            at an item with ``inplace=True``; a list of segment sizes summing to
            the number of modules; or a :class:`~seqckpt.planner.Plan`, e.g. from
            :func:`seqckpt.plan`; or ``"auto"``: for each batch, the fastest plan
            that fits ``memory_budget`` (or, for an input on CUDA, the free
            memory less what the step has yet to allocate), chosen from the
            chain's frontier: profiled once (and once more at a second size),
            then predicted for every input shape (see
            :mod:`seqckpt.planner.adaptive`); profiled anew for each set of
            trainable parameters (layers frozen or unfrozen) and autocast
            state.
        input: passed to the first module, as ``nn.Sequential`` does; tuples and
            dicts flowing between stages are fine.
        use_reentrant: accepted for torch compatibility and ignored.
        preserve_rng_state: see :func:`seqckpt.checkpoint`.
        determinism_check: see :func:`seqckpt.checkpoint`.
        context_fn: see :func:`seqckpt.checkpoint`; called once per region.
        debug: see :func:`seqckpt.checkpoint`.
        early_stop: see :func:`seqckpt.checkpoint`.
        memory_budget: with ``segments="auto"``: bytes, a string such as
            ``"512MiB"`` (see :func:`seqckpt.plan`), or a callable returning the
            bytes available now, called at every step.
        policy: what each checkpointed segment keeps (see
            :func:`seqckpt.checkpoint`), with ``segments`` a count or sizes; a
            plan carries its own per segment.
        respect_saved_tensors_hooks: see :func:`seqckpt.checkpoint`.

    Returns:
        The output of the last module. Outputs, gradients and buffers are bitwise
        those of the plain run on CPU.

    Raises:
        TypeError: ``functions`` or ``segments`` of a wrong type, a non-callable item.
        ValueError: an empty chain, ``segments`` out of range or sizes that do not
            sum to the number of modules.

    Example:
        >>> import torch, seqckpt
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> y = seqckpt.checkpoint_sequential(model, 3, x)   # sizes 2, 2, 2
        >>> y = seqckpt.checkpoint_sequential(model, [3, 2, 1], x)
        >>> y.sum().backward()
    """
    chain = as_chain(functions, "functions")
    if isinstance(use_reentrant, torch.Tensor):
        raise TypeError(
            "seqckpt: checkpoint_sequential takes one input (argument 'input'), "
            "but a tensor came as its fourth positional argument, where torch's "
            "signature has use_reentrant. Pass several inputs as one tuple, "
            "checkpoint_sequential(chain, segments, (a, b)), to a first module "
            "that takes the tuple."
        )
    options = make_options(
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        context_fn=context_fn,
        debug=debug,
        early_stop=early_stop,
        use_reentrant=use_reentrant,
        respect_saved_tensors_hooks=respect_saved_tensors_hooks,
    )
    chosen = as_policy(policy)
    if not torch.is_grad_enabled():
        if segments != "auto":
            resolve_plan(segments, chain, chosen)
        for module in chain:
            input = module(input)
        return input
    return run_segments(segments, chain, input, memory_budget, chosen, options)


def _fitted(segments: Segments, n: int) -> Segments:
    """A :class:`CheckpointedSequential`'s ``segments`` for its ``n`` modules
    now: a count capped at ``n``, as for a slice; sizes or a plan made for
    another length (the chain was changed in place since) raise, saying so."""
    if isinstance(segments, int):
        return min(segments, n)
    if isinstance(segments, Plan):
        covers = segments.stop
    elif isinstance(segments, (list, tuple)) and all(type(s) is int for s in segments):
        covers = sum(segments)
    else:
        return segments  # not a form segments take: resolve_plan says so
    if covers == n:
        return segments
    what = "plan" if isinstance(segments, Plan) else f"sizes {list(segments)}"
    raise ValueError(
        f"seqckpt: this CheckpointedSequential has {n} modules now, but its "
        f"segments ({what}) cover {covers}: the chain changed after they were "
        "set (append, insert, extend, pop, del). Set its segments for the chain "
        f"as it is (sizes summing to {n}, a count, or None for the default)."
    )


class CheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose forward is checkpointed while training.

    Constructed like ``nn.Sequential`` (modules, or one ``OrderedDict``) plus the
    keyword ``segments`` (any form :func:`checkpoint_sequential` accepts) and the
    checkpoint options. The default, ``segments=None``, is about sqrt(n)
    balanced segments and at least two for two or more modules, so every chain
    of two or more modules checkpoints something; a single module runs plainly
    (with a warning: there is nothing to checkpoint but the whole, use
    :func:`seqckpt.checkpoint` for that). Its ``state_dict`` keys are those of
    the ``nn.Sequential`` it replaces, and indexing, slicing, ``len`` and
    ``append`` behave the same. A slice, ``+`` and ``*`` give a
    ``CheckpointedSequential`` with the same options, policy, budget and
    training mode (``nn.Sequential`` would give a plain ``Sequential`` for
    ``+`` and ``*``, and a slice in training mode with default options); a
    segment count carries over, capped at the new length, as does ``"auto"``,
    while segment sizes and plans, made for the whole chain, fall back to the
    default. Changed in place (``append``, ``insert``, ``extend``, ``pop``,
    ``del``), it keeps its segments: a count is capped at the new length,
    sizes or a plan for the old length raise until ``segments`` is set again.
    In ``eval()`` mode or without grad its forward is exactly
    ``nn.Sequential.forward``.

    Example:
        >>> import torch
        >>> from seqckpt import CheckpointedSequential
        >>> model = CheckpointedSequential(
        ...     *[torch.nn.Linear(8, 8) for _ in range(4)], segments=2)
        >>> model(torch.randn(3, 8)).sum().backward()
        >>> plain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> plain.load_state_dict(model.state_dict())
        <All keys matched successfully>
    """

    def __init__(
        self,
        *args: Any,
        segments: Segments | None = None,
        use_reentrant: bool | None = None,
        preserve_rng_state: bool = True,
        determinism_check: DeterminismCheck = "default",
        context_fn: ContextFn | None = None,
        debug: bool = False,
        early_stop: bool = True,
        memory_budget: BudgetSource | None = None,
        policy: Any = None,
        respect_saved_tensors_hooks: bool | None = None,
    ) -> None:
        super().__init__(*args)
        self.options = make_options(
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            context_fn=context_fn,
            debug=debug,
            early_stop=early_stop,
            use_reentrant=use_reentrant,
            respect_saved_tensors_hooks=respect_saved_tensors_hooks,
        )
        if memory_budget is not None and not callable(memory_budget):
            parse_budget(memory_budget)
        _check_budget_use(segments, memory_budget)
        self.policy = as_policy(policy)
        if segments is not None and segments != "auto" and len(self) > 0:
            resolve_plan(segments, list(self), self.policy)  # fail early
        if segments == "auto":
            _check_no_policy_with_auto(self.policy)
        self.segments = segments
        self.memory_budget = memory_budget
        self._warned_single = False

    @classmethod
    def from_sequential(
        cls,
        sequential: nn.Sequential,
        segments: Segments | None = None,
        **options: Any,
    ) -> CheckpointedSequential:
        """Wrap the modules of ``sequential`` (the same objects, not copies).

        Example:
            >>> import torch
            >>> from seqckpt import CheckpointedSequential
            >>> seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            >>> ckpt = CheckpointedSequential.from_sequential(seq, segments=1)
            >>> ckpt[0] is seq[0]
            True
        """
        if not isinstance(sequential, nn.Sequential):
            raise TypeError(
                "seqckpt: from_sequential() needs an nn.Sequential, got "
                f"{type(sequential).__name__}."
            )
        module = cls(OrderedDict(sequential._modules), segments=segments, **options)
        module.train(sequential.training)
        return module

    def __getitem__(self, idx: slice | int) -> nn.Module:
        item = super().__getitem__(idx)
        return self._with_my_options(item) if isinstance(idx, slice) else item

    def __add__(self, other: nn.Sequential) -> CheckpointedSequential:
        return self._with_my_options(super().__add__(other))

    def __mul__(self, other: int) -> CheckpointedSequential:
        return self._with_my_options(super().__mul__(other))

    def __rmul__(self, other: int) -> CheckpointedSequential:
        return self.__mul__(other)

    @torch.jit.unused  # type: ignore[untyped-decorator]
    def _with_my_options(self, modules: nn.Module) -> CheckpointedSequential:
        """``modules`` (a slice, sum or product of this one) as a
        ``CheckpointedSequential`` configured as this one."""
        new = type(self)(OrderedDict(modules._modules))
        new.options, new.policy = self.options, self.policy
        new.memory_budget = self.memory_budget
        if isinstance(self.segments, int) and len(new) > 0:
            new.segments = min(self.segments, len(new))
        elif self.segments == "auto":
            new.segments = "auto"
        # else the default (None): sizes or a plan fit only the whole chain
        new.train(self.training)
        return new

    # Unannotated, as nn.Sequential's: TorchScript reads the input as a
    # tensor, Python takes anything (tuples, dicts).
    def forward(self, input):  # type: ignore[no-untyped-def]
        scripting = torch.jit.is_scripting()  # type: ignore[attr-defined]
        if not scripting and self.training and torch.is_grad_enabled():
            return self._checkpointed(input)
        for module in self:  # nn.Sequential's forward, in a form TorchScript takes
            input = module(input)
        return input

    @torch.jit.unused  # type: ignore[untyped-decorator]
    def _checkpointed(self, input):  # type: ignore[no-untyped-def]
        """The training forward, checkpointed. ``torch.jit.script`` compiles
        only the plain forward: a scripted model does not checkpoint."""
        if len(self) == 0:
            return input
        chain = list(self)
        segments = self.segments
        if segments is None:
            segments = default_segments(len(chain))
            if segments == 1 and not self._warned_single:
                self._warned_single = True
                warnings.warn(
                    "seqckpt: CheckpointedSequential with a single module "
                    "checkpoints nothing (its only segment is the last one, which "
                    "runs plainly); wrap the module with seqckpt.checkpoint to "
                    "recompute it whole.",
                    stacklevel=2,
                )
        elif segments != "auto":
            segments = _fitted(segments, len(chain))
        token = (
            None  # (dynamo cannot trace the context variable)
            if torch.compiler.is_compiling()
            else _RUNNING.set((*_RUNNING.get(), self))
        )
        try:
            return run_segments(
                segments, chain, input, self.memory_budget, self.policy, self.options
            )
        finally:
            if token is not None:
                _RUNNING.reset(token)

    def extra_repr(self) -> str:
        plan = self.segments
        parts = []
        if isinstance(plan, Plan):  # one line (print(stack.segments) shows the tree)
            parts.append(
                f"segments=<plan for modules {plan.start}-{plan.stop - 1}, "
                f"{plan.checkpoints()} checkpoints>"
            )
        elif plan is not None:
            parts.append(f"segments={plan!r}")
        if self.memory_budget is not None:
            parts.append(f"memory_budget={self.memory_budget!r}")
        if self.policy is not None:
            parts.append(f"policy={self.policy}")
        return ", ".join(parts)
