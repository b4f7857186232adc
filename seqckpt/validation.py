"""Validation: run a model plainly and checkpointed from the same RNG state and
report whether gradients match, how much peak memory dropped and what it cost.

Example:
    >>> import seqckpt
    >>> rows = seqckpt.validate("mlp", device="cpu")
    >>> rows[0]["bitwise_equal"], rows[0]["ok"]
    (True, True)
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from seqckpt.memory import timed, track_memory
from seqckpt.models import MODELS
from seqckpt.sequential import checkpoint_sequential

__all__ = ["validate"]

# On CUDA without deterministic algorithms, gradients are compared with this,
# or against the device's own floor: a gradient passes when it is within
# NOISE_FACTOR times the difference between two plain runs (cuDNN's convolution
# backward, for one, sums in an order that changes from run to run).
CUDA_RTOL, CUDA_ATOL = 1e-4, 1e-6
NOISE_FACTOR = 4.0


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"seqckpt: --device must be 'cpu' or 'cuda', got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "seqckpt: --device cuda was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}); use --device cpu."
        )
    return torch.device(device)


def model_names(model: str) -> list[str]:
    if model == "all":
        return list(MODELS)
    if model not in MODELS:
        raise ValueError(
            f"seqckpt: unknown --model {model!r}; choose one of "
            f"{', '.join(MODELS)} or 'all'."
        )
    return [model]


def _step(
    model: nn.Module, x: torch.Tensor, forward: Callable[[nn.Module, torch.Tensor], Any]
) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    forward(model, x).float().sum().backward()


def _time(
    model: nn.Module,
    x: torch.Tensor,
    forward: Callable[[nn.Module, torch.Tensor], Any],
    device: torch.device,
    repeats: int,
) -> float:
    return statistics.median(
        timed(lambda: _step(model, x, forward), device)[1] for _ in range(repeats)
    )


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _differences(
    a: nn.Module, b: nn.Module
) -> tuple[bool, bool, float, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(gradients bitwise equal, buffers bitwise equal, largest gradient
    difference, the gradient pairs) of two models after one step each."""
    grads = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters())]  # noqa: B905
    same_none = all((g is None) == (h is None) for g, h in grads)
    pairs = [(g, h) for g, h in grads if g is not None and h is not None]
    grads_equal = same_none and all(torch.equal(g, h) for g, h in pairs)
    buffers_equal = all(
        torch.equal(u, v)
        for u, v in zip(a.buffers(), b.buffers())  # noqa: B905
    )
    max_diff = max((_largest_difference(g, h) for g, h in pairs), default=0.0)
    return grads_equal, buffers_equal, max_diff, pairs


def grads_close(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    baseline: list[tuple[torch.Tensor, torch.Tensor]],
) -> bool:
    """Whether every checkpointed gradient matches the plain one on a device
    whose kernels are not deterministic: ``allclose(rtol=CUDA_RTOL,
    atol=CUDA_ATOL)``, or a largest difference at most ``NOISE_FACTOR`` times
    the one between two plain runs of the same tensor (``baseline``, pairs in
    the same order). A zero floor leaves only ``allclose``.

    Example:
        >>> a = torch.tensor([1.0, 2.0])
        >>> grads_close([(a, a + 1e-3)], [(a, a + 5e-4)])
        True
        >>> grads_close([(a, a + 1e-2)], [(a, a + 5e-4)])
        False
    """
    return all(
        torch.allclose(a, b, rtol=CUDA_RTOL, atol=CUDA_ATOL)
        or _largest_difference(a, b) <= NOISE_FACTOR * _largest_difference(c, d)
        for (a, b), (c, d) in zip(pairs, baseline, strict=True)
    )


def validate_one(
    name: str,
    device: torch.device,
    segments: int | None = None,
    batch: int | None = None,
    repeats: int = 3,
) -> dict[str, Any]:
    """Validate one embedded model; returns its row (see :func:`validate`)."""
    spec = MODELS[name]
    k = spec.segments if segments is None else segments
    model = spec.build().to(device)
    x = spec.sample(device, batch)

    def plain(m: nn.Module, t: torch.Tensor) -> Any:
        return m(t)

    def checkpointed(m: nn.Module, t: torch.Tensor) -> Any:
        return checkpoint_sequential(cast(nn.Sequential, m), k, t)

    # Warm up on throwaway copies: the first cuBLAS / cuDNN calls allocate
    # workspaces that stay, which would otherwise count against whichever
    # variant is measured first.
    for forward in (plain, checkpointed):
        _step(copy.deepcopy(model), x, forward)

    # One measured step each from identical state: memory and gradients. The
    # plain run twice, so that the difference the device's kernels make by
    # themselves is known (zero on the CPU and with deterministic algorithms).
    runs = {
        label: (copy.deepcopy(model), forward)
        for label, forward in (
            ("plain", plain),
            ("plain again", plain),
            ("checkpointed", checkpointed),
        )
    }
    peaks, reserved = {}, {}
    for label, (m, forward) in runs.items():
        if device.type == "cuda":
            # Reserved growth is each variant's own: not served from blocks an
            # earlier variant left cached.
            torch.cuda.empty_cache()
        with track_memory(device) as mem:
            _step(m, x, forward)
        peaks[label], reserved[label] = mem.peak_bytes, mem.peak_reserved_bytes
    reference = runs["plain"][0]
    grads_equal, buffers_equal, max_diff, pairs = _differences(
        reference, runs["checkpointed"][0]
    )
    *_, baseline_diff, baseline = _differences(reference, runs["plain again"][0])
    bitwise = grads_equal and buffers_equal
    deterministic = device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
    if deterministic:
        grads_ok, rule = grads_equal, "bitwise"
    else:
        grads_ok = grads_close(pairs, baseline)
        rule = (
            f"allclose(rtol={CUDA_RTOL}, atol={CUDA_ATOL}) or within "
            f"{NOISE_FACTOR:g}x the plain-vs-plain difference"
        )

    # Timing: every variant is warm by now.
    ckpt_model = runs["checkpointed"][0]
    t_plain = _time(reference, x, plain, device, repeats)
    t_ckpt = _time(ckpt_model, x, checkpointed, device, repeats)
    reduction = (
        100.0 * (1 - peaks["checkpointed"] / peaks["plain"]) if peaks["plain"] else 0.0
    )
    memory_ok = peaks["checkpointed"] < peaks["plain"]
    reason = ""
    if not grads_ok:
        reason = f"gradients differ ({rule} failed, max abs diff {max_diff:.3g})"
    elif not buffers_equal:
        reason = "buffers differ (BatchNorm statistics are compared exactly)"
    elif not memory_ok:
        reason = "peak memory did not drop"
    return {
        "model": name,
        "device": str(device),
        "segments": k,
        "batch": x.shape[0],
        "peak_mib_plain": peaks["plain"] / 2**20,
        "peak_mib_checkpointed": peaks["checkpointed"] / 2**20,
        "reserved_mib_plain": reserved["plain"] / 2**20,
        "reserved_mib_checkpointed": reserved["checkpointed"] / 2**20,
        "reduction_pct": reduction,
        "time_ratio": t_ckpt / t_plain,
        "max_abs_grad_diff": max_diff,
        "plain_vs_plain_max_abs_grad_diff": baseline_diff,
        "bitwise_equal": bitwise,
        "grad_rule": rule,
        "ok": grads_ok and buffers_equal and memory_ok,
        "reason": reason,
    }


# What cuBLAS needs for deterministic results; read when CUDA first starts.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def make_deterministic() -> None:
    """Ask for deterministic kernels: the cuBLAS workspace setting (only takes
    effect before CUDA starts, so call this first) and
    ``torch.use_deterministic_algorithms(True)``. ``python -m seqckpt validate
    --deterministic`` calls it before anything touches CUDA."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True)


def validate(
    model: str = "all",
    device: str | None = None,
    segments: int | None = None,
    batch: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Validate checkpointing on the embedded models.

    For each model, after a warm-up step of each variant on throwaway copies
    (the first cuBLAS and cuDNN calls allocate workspaces that stay), runs one
    training step plainly, a second plain one and one checkpointed with
    :func:`seqckpt.checkpoint_sequential`, all from the same weights and RNG
    seed, and reports peak memory (``seqckpt.track_memory``: allocated, and on
    CUDA reserved), the step-time ratio (median of ``3`` steps each) and whether
    gradients and buffers match. Gradients: bitwise on the CPU and with
    deterministic algorithms (see :func:`make_deterministic`), otherwise
    ``allclose(rtol=1e-4, atol=1e-6)`` or, per tensor, within 4x the
    difference between two plain runs (the device's own floor, also reported;
    see :func:`grads_close`). Buffers (BatchNorm
    statistics): always exactly.

    Args:
        model: a name from :data:`seqckpt.models.MODELS`, or ``"all"``.
        device: ``"cpu"``, ``"cuda"`` or None (CUDA when available).
        segments: segment count; None uses each model's default.
        batch: batch size; None uses the model's CPU or GPU default.
        progress: print a line per model on stderr.

    Returns:
        One dict per model with keys ``model, device, segments, batch,
        peak_mib_plain, peak_mib_checkpointed, reserved_mib_plain,
        reserved_mib_checkpointed, reduction_pct, time_ratio,
        max_abs_grad_diff, plain_vs_plain_max_abs_grad_diff, bitwise_equal,
        grad_rule, ok, reason``.

    Raises:
        ValueError: unknown model, CUDA asked for without a GPU, segments out of
            range for a model, a batch below 1.

    Example:
        >>> import seqckpt
        >>> (row,) = seqckpt.validate("mlp", device="cpu")
        >>> row["bitwise_equal"], row["ok"], row["reduction_pct"] > 0
        (True, True, True)
    """
    dev = resolve_device(device)
    names = model_names(model)
    if batch is not None and batch < 1:
        raise ValueError(f"seqckpt: --batch must be at least 1, got {batch}.")
    rows = []
    for name in names:
        if progress:
            print(
                f"seqckpt: validating {name} on {dev} ...", file=sys.stderr, flush=True
            )
        n = len(MODELS[name].build())
        if segments is not None and not 1 <= segments <= n:
            raise ValueError(
                f"seqckpt: --segments must be between 1 and {n} for model {name!r} "
                f"({n} modules), got {segments}."
            )
        rows.append(validate_one(name, dev, segments, batch))
    return rows
