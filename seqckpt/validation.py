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

# On CUDA without deterministic algorithms, gradients are compared with this.
CUDA_RTOL, CUDA_ATOL = 1e-4, 1e-6


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
    plain_model = spec.build().to(device)
    ckpt_model = copy.deepcopy(plain_model)
    x = spec.sample(device, batch)

    def plain(m: nn.Module, t: torch.Tensor) -> Any:
        return m(t)

    def checkpointed(m: nn.Module, t: torch.Tensor) -> Any:
        return checkpoint_sequential(cast(nn.Sequential, m), k, t)

    # One measured step each from identical state: memory and gradients.
    peaks = {}
    for label, model, forward in (
        ("plain", plain_model, plain),
        ("checkpointed", ckpt_model, checkpointed),
    ):
        with track_memory(device) as mem:
            _step(model, x, forward)
        peaks[label] = mem.peak_bytes
    grads = [
        (p.grad, q.grad)
        for p, q in zip(plain_model.parameters(), ckpt_model.parameters(), strict=False)
    ]
    tensors = grads + list(
        zip(plain_model.buffers(), ckpt_model.buffers(), strict=False)
    )
    bitwise = all(
        torch.equal(a, b) for a, b in tensors if a is not None and b is not None
    )
    bitwise = bitwise and all((a is None) == (b is None) for a, b in grads)
    max_diff = max(
        (
            (a.float() - b.float()).abs().max().item()
            for a, b in grads
            if a is not None and b is not None
        ),
        default=0.0,
    )
    if device.type == "cpu" or torch.are_deterministic_algorithms_enabled():
        grads_ok, rule = bitwise, "bitwise"
    else:
        grads_ok = all(
            torch.allclose(a, b, rtol=CUDA_RTOL, atol=CUDA_ATOL)
            for a, b in grads
            if a is not None and b is not None
        )
        rule = f"allclose(rtol={CUDA_RTOL}, atol={CUDA_ATOL})"

    # Timing: warm-up already done by the measured steps above.
    t_plain = _time(plain_model, x, plain, device, repeats)
    t_ckpt = _time(ckpt_model, x, checkpointed, device, repeats)
    reduction = (
        100.0 * (1 - peaks["checkpointed"] / peaks["plain"]) if peaks["plain"] else 0.0
    )
    memory_ok = peaks["checkpointed"] < peaks["plain"]
    reason = ""
    if not grads_ok:
        reason = f"gradients differ ({rule} failed, max abs diff {max_diff:.3g})"
    elif not memory_ok:
        reason = "peak memory did not drop"
    return {
        "model": name,
        "device": str(device),
        "segments": k,
        "batch": x.shape[0],
        "peak_mib_plain": peaks["plain"] / 2**20,
        "peak_mib_checkpointed": peaks["checkpointed"] / 2**20,
        "reduction_pct": reduction,
        "time_ratio": t_ckpt / t_plain,
        "max_abs_grad_diff": max_diff,
        "bitwise_equal": bitwise,
        "grad_rule": rule,
        "ok": grads_ok and memory_ok,
        "reason": reason,
    }


def validate(
    model: str = "all",
    device: str | None = None,
    segments: int | None = None,
    batch: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Validate checkpointing on the embedded models.

    For each model, runs one training step plainly and one checkpointed with
    :func:`seqckpt.checkpoint_sequential`, from the same weights and RNG seed, and
    reports peak memory (``seqckpt.track_memory``), the step-time ratio (median of
    ``3`` steps each) and whether gradients and buffers match: bitwise on the CPU
    and on CUDA with ``torch.use_deterministic_algorithms(True)``, otherwise
    ``allclose(rtol=1e-4, atol=1e-6)``.

    Args:
        model: a name from :data:`seqckpt.models.MODELS`, or ``"all"``.
        device: ``"cpu"``, ``"cuda"`` or None (CUDA when available).
        segments: segment count; None uses each model's default.
        batch: batch size; None uses the model's CPU or GPU default.
        progress: print a line per model on stderr.

    Returns:
        One dict per model with keys ``model, device, segments, batch,
        peak_mib_plain, peak_mib_checkpointed, reduction_pct, time_ratio,
        max_abs_grad_diff, bitwise_equal, grad_rule, ok, reason``.

    Raises:
        ValueError: unknown model, CUDA asked for without a GPU, segments out of
            range for a model, a batch below 1.
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
