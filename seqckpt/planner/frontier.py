"""The memory/time frontier: planned schedules at several budgets against uniform
segment counts (seqckpt's and torch's), each measured on the real step.

Example:
    >>> import torch
    >>> from seqckpt.planner.frontier import measure_step
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    >>> m = measure_step(model, torch.randn(16, 32), 2, "cpu", repeats=1)
    >>> m.peak_bytes > 0 and m.seconds > 0
    True
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from seqckpt._tree import tensors_in
from seqckpt.checkpoint import TORCH_CHECKPOINT, TORCH_CHECKPOINT_SEQUENTIAL
from seqckpt.executor import resolve_plan, run_plan
from seqckpt.memory import timed, track_memory
from seqckpt.planner.budget import format_bytes
from seqckpt.planner.cost import CostModel
from seqckpt.planner.profile import ChainProfile, backward_with_loss_grad
from seqckpt.planner.solver import fastest_plan, least_memory
from seqckpt.planner.tree import Plan, Run
from seqckpt.policies import COMPUTE_HEAVY

__all__ = [
    "TORCH_SAC",
    "FrontierPoint",
    "StepMeasurement",
    "frontier",
    "measure_peak",
    "measure_step",
    "measure_steps",
    "torch_every_block",
    "torch_sac_every_block",
    "torch_uniform",
    "training_step",
]


@dataclass(frozen=True)
class StepMeasurement:
    """Peak bytes of one training step beyond parameters, their gradients and
    the input, and the median seconds of ``repeats`` steps."""

    peak_bytes: int
    seconds: float


Forward = Callable[[nn.Sequential, Any], Any]


def torch_uniform(k: int) -> Forward:
    """torch's ``checkpoint_sequential`` (non-reentrant) in ``k`` segments."""

    def run(model: nn.Sequential, x: Any) -> Any:
        return TORCH_CHECKPOINT_SEQUENTIAL(model, k, x, use_reentrant=False)

    return run


def torch_every_block(model: nn.Sequential, x: Any) -> Any:
    """timm-style: every block its own torch (non-reentrant) checkpoint."""
    for block in model:
        x = TORCH_CHECKPOINT(block, x, use_reentrant=False)
    return x


def _keep_heavy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if COMPUTE_HEAVY.keeps(op, args, kwargs):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


TORCH_SAC = functools.partial(
    torch_checkpoint.create_selective_checkpoint_contexts, _keep_heavy
)


def torch_sac_every_block(model: nn.Sequential, x: Any) -> Any:
    """Every block its own torch checkpoint under torch's selective
    checkpointing keeping what ``"compute_heavy"`` keeps (matmuls,
    convolutions, fused attention)."""
    for block in model:
        x = TORCH_CHECKPOINT(block, x, use_reentrant=False, context_fn=TORCH_SAC)
    return x


def training_step(model: nn.Sequential, x: Any, forward: Forward) -> None:
    """One training step as the planner counts it: ``forward(model, x)``, a
    loss-like output gradient, backward (see
    :func:`~seqckpt.planner.profile.backward_with_loss_grad`); gradients that
    reached the input are dropped, so steps do not accumulate into them."""
    backward_with_loss_grad(forward(model, x))
    for t in tensors_in(x):
        t.grad = None


def measure_peak(
    model: nn.Sequential, x: Any, forward: Forward, device: str | torch.device
) -> int:
    """Peak bytes one warmed-up :func:`training_step` adds beyond the parameters,
    their gradients (allocated first, as a memory budget leaves them out) and the
    input."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    training_step(model, x, forward)  # warm-up
    with track_memory(device) as mem:
        training_step(model, x, forward)
    return mem.peak_bytes


def _as_forward(segments: int | Plan | Forward, model: nn.Sequential) -> Forward:
    if callable(segments):
        return segments
    plan = resolve_plan(segments, list(model))

    def forward(m: nn.Sequential, t: Any) -> Any:
        return run_plan(plan, list(m), t)

    return forward


def _under_autocast(forward: Forward, device_type: str, dtype: torch.dtype) -> Forward:
    def under(m: nn.Sequential, t: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(m, t)

    return under


def measure_steps(
    model: nn.Sequential,
    x: Any,
    schedules: list[int | Plan | Forward],
    device: str | torch.device,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    autocast: torch.dtype | None = None,
) -> list[StepMeasurement]:
    """Measure each schedule's peak (:func:`measure_peak`) and the median time
    of ``repeats`` :func:`training_step` s, the steps taken side by side: round
    after round, one step of every schedule per round, so that a machine that
    slows down or speeds up while it runs moves every schedule alike (timed one
    after the other, two runs of the same schedule differed by 15% here).

    Args:
        model: the chain.
        x: its input.
        schedules: for each, anything :func:`seqckpt.checkpoint_sequential`
            takes as segments, or a function ``(model, x) -> output``.
        device: where the step runs and memory is measured.
        repeats: rounds of steps; each schedule's time is its median.
        progress: told what is measured next.
        autocast: a dtype to run each forward under ``torch.autocast`` with
            (backward after it, as torch's mixed-precision recipe runs it).

    Returns:
        One measurement per schedule, in order. The model's gradients and
        buffers are changed as by any training steps.
    """
    dev = torch.device(device)
    forwards = [_as_forward(s, model) for s in schedules]
    if autocast is not None:
        forwards = [_under_autocast(f, dev.type, autocast) for f in forwards]
    peaks = []
    for i, forward in enumerate(forwards):
        if progress:
            progress(f"peak {i + 1} of {len(forwards)}")
        peaks.append(measure_peak(model, x, forward, dev))
    times: list[list[float]] = [[] for _ in forwards]
    for r in range(repeats):
        if progress:
            progress(f"times, round {r + 1} of {repeats}")
        for forward, taken in zip(forwards, times, strict=True):
            taken.append(
                timed(functools.partial(training_step, model, x, forward), dev)[1]
            )
    return [
        StepMeasurement(peak, statistics.median(taken))
        for peak, taken in zip(peaks, times, strict=True)
    ]


def measure_step(
    model: nn.Sequential,
    x: Any,
    segments: int | Plan | Forward,
    device: str | torch.device,
    repeats: int = 3,
    autocast: torch.dtype | None = None,
) -> StepMeasurement:
    """Measure the peak (:func:`measure_peak`) and the median time of ``repeats``
    :func:`training_step` s of ``model`` run with ``segments`` (anything
    :func:`seqckpt.checkpoint_sequential` takes, or a function
    ``(model, x) -> output``), its forward under ``torch.autocast`` with
    ``autocast``'s dtype when given. The model's gradients and buffers are
    changed as by any training step."""
    return measure_steps(model, x, [segments], device, repeats, autocast=autocast)[0]


@dataclass(frozen=True)
class FrontierPoint:
    """One schedule on the frontier: ``kind`` is "planned", "seqckpt uniform" or
    "torch uniform"; ``label`` the budget or the segment count."""

    kind: str
    label: str
    measured: StepMeasurement
    predicted_peak_bytes: int | None = None
    predicted_time: float | None = None


def frontier(
    model: nn.Sequential,
    x: Any,
    profile: ChainProfile,
    device: str | torch.device,
    points: int = 8,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    autocast: torch.dtype | None = None,
) -> list[FrontierPoint]:
    """Measure planned schedules at ``points`` budgets spread from the smallest
    feasible peak to the keep-everything peak (with the profile's policies, and
    without any when it has some), every uniform segment count with seqckpt and
    with ``torch.utils.checkpoint.checkpoint_sequential``, and torch's
    checkpoint of every block, plain and under its selective checkpointing.
    All are timed side by side (:func:`measure_steps`), their forwards under
    ``torch.autocast`` with ``autocast``'s dtype when given (profile under it
    too)."""
    from seqckpt.planner.planning import with_policies

    model_costs = CostModel.of(profile)
    n = len(model_costs)
    floor, _ = least_memory(model_costs)
    top, _ = model_costs.total((Run(0, n),))
    # (kind, label, schedule, predicted peak, predicted time)
    chosen: list[tuple[str, str, int | Plan | Forward, int | None, float | None]] = []
    kinds = [("planned", profile)]
    if profile.policies:
        kinds = [
            ("planned", profile),
            ("planned, no policy", with_policies(profile, [None])),
        ]
    for kind, chosen_profile in kinds:
        for i in range(points):
            budget = int(floor + (top - floor) * i / max(1, points - 1))
            plan = fastest_plan(chosen_profile, budget)
            label = format_bytes(budget)
            chosen.append(
                (kind, label, plan, plan.predicted_peak_bytes, plan.predicted_time)
            )
    chosen.append(("torch every block", "-", torch_every_block, None, None))
    chosen.append(("torch every block SAC", "-", torch_sac_every_block, None, None))
    for k in range(1, n + 1):
        chosen.append(("seqckpt uniform", f"{k}", k, None, None))
        chosen.append(("torch uniform", f"{k}", torch_uniform(k), None, None))
    measured = measure_steps(
        model, x, [c[2] for c in chosen], device, repeats, progress, autocast
    )
    return [
        FrontierPoint(kind, label, m, peak, time)
        for (kind, label, _, peak, time), m in zip(chosen, measured, strict=True)
    ]


def format_frontier(points: list[FrontierPoint]) -> str:
    """The frontier as a text table, one row per measured schedule."""
    lines = [f"{'schedule':<17}{'budget/k':>12}{'peak MiB':>10}{'step ms':>10}"
             f"{'pred MiB':>10}{'pred ms':>10}"]  # fmt: skip
    for p in points:
        pred_mib = (
            f"{p.predicted_peak_bytes / 2**20:.2f}" if p.predicted_peak_bytes else "-"
        )
        pred_ms = f"{p.predicted_time * 1e3:.1f}" if p.predicted_time else "-"
        lines.append(
            f"{p.kind:<17}{p.label:>12}{p.measured.peak_bytes / 2**20:>10.2f}"
            f"{p.measured.seconds * 1e3:>10.1f}{pred_mib:>10}{pred_ms:>10}"
        )
    return "\n".join(lines)


def plot_frontier(points: list[FrontierPoint], path: str, title: str) -> bool:
    """Draw measured step time against peak memory into ``path``; False (nothing
    drawn) when matplotlib, an optional extra, is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {
        "planned": ("o-", "seqckpt.plan (budgets, policies)"),
        "planned, no policy": ("o--", "seqckpt.plan (budgets, no policy)"),
        "seqckpt uniform": ("s--", "seqckpt uniform k"),
        "torch uniform": ("^:", "torch checkpoint_sequential k"),
        "torch every block": ("v", "torch checkpoint per block"),
        "torch every block SAC": ("D", "torch SAC per block (compute-heavy kept)"),
    }
    for kind, (style, label) in styles.items():
        chosen = sorted(
            (p for p in points if p.kind == kind), key=lambda p: p.measured.peak_bytes
        )
        ax.plot(
            [p.measured.peak_bytes / 2**20 for p in chosen],
            [p.measured.seconds * 1e3 for p in chosen],
            style,
            label=label,
        )
    ax.set_xlabel("measured peak activation memory (MiB)")
    ax.set_ylabel("measured step time (ms, median)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
