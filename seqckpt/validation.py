"""Validation: run a model plainly and checkpointed from the same RNG state and
report whether gradients match, how much peak memory dropped and what it cost:
an embedded model by name, or your own chain or whole model with a sample batch.

Example:
    >>> import seqckpt
    >>> rows = seqckpt.validate("mlp", device="cpu")
    >>> rows[0]["bitwise_equal"], rows[0]["ok"]
    (True, True)
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from seqckpt._chain import as_chain
from seqckpt._tree import replace_tensors, tensors_in
from seqckpt.blocks import CheckpointedForward, checkpoint_blocks
from seqckpt.memory import timed, track_memory
from seqckpt.models import MODELS
from seqckpt.policies import Policy, as_policy
from seqckpt.sequential import CheckpointedSequential, checkpoint_sequential

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


# A variant's forward: the model and the sample in, the output out.
Forward = Callable[[nn.Module, Any], Any]


def _step(model: nn.Module, x: Any, forward: Forward) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = forward(model, x)
    # the sum of every output tensor that requires grad (a head's logits, an HF
    # model's output fields, an LSTM's output and state)
    sums = [t.float().sum() for t in tensors_in(out) if t.requires_grad]
    if not sums:
        raise TypeError(
            "seqckpt: validate backpropagates the sum of the output's tensors, "
            f"but {type(model).__name__} returned {type(out).__name__} holding "
            "none that requires grad. Make it return its activations (a head's "
            "output, a loss)."
        )
    torch.autograd.backward(sums)


def _time(
    model: nn.Module,
    x: Any,
    forward: Forward,
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
    theirs = dict(b.named_parameters())
    grads = [(p.grad, theirs[name].grad) for name, p in a.named_parameters()]
    same_none = all((g is None) == (h is None) for g, h in grads)
    pairs = [(g, h) for g, h in grads if g is not None and h is not None]
    grads_equal = same_none and all(torch.equal(g, h) for g, h in pairs)
    their_buffers = dict(b.named_buffers())
    buffers_equal = all(
        torch.equal(u, their_buffers[name]) for name, u in a.named_buffers()
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
    policy: Policy | None = None,
) -> dict[str, Any]:
    """Validate one embedded model; returns its row (see :func:`validate`)."""
    spec = MODELS[name]
    k = spec.segments if segments is None else segments
    model = spec.build().to(device)
    variants, shape = _chain_variants(k, len(model), policy)
    x = spec.sample(device, batch)
    return _compare(name, model, x, device, *variants, shape, repeats)


def validate_yours(
    model: nn.Module,
    sample: Any,
    device: str | None = None,
    segments: int | None = None,
    batch: int | None = None,
    progress: bool = False,
    repeats: int = 3,
    policy: Policy | None = None,
) -> dict[str, Any]:
    """Validate your own chain or whole model on ``sample``; returns its row
    (see :func:`validate`). The model is copied (yours gets no gradients and
    stays where it is); ``device`` None runs where the sample is."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            "seqckpt: argument 'model' of validate must be the name of an embedded "
            f"model ({', '.join(MODELS)} or 'all'), your chain (an nn.Sequential "
            "or nn.ModuleList) or your model (an nn.Module), got "
            f"{type(model).__name__}."
        )
    # (a container subclass with a forward of its own is a model: a chain's
    # run would skip what that forward does between the layers; a
    # CheckpointedSequential's forward is its chain's, checkpointed)
    chain = isinstance(model, (nn.Sequential, nn.ModuleList)) and type(
        model
    ).forward in (
        nn.Sequential.forward,
        nn.ModuleList.forward,
        CheckpointedSequential.forward,
    )
    what = "chain" if chain else "model"
    if sample is None:
        taken = (
            "what the chain's first layer takes"
            if chain
            else "a dict of keywords, a tuple of arguments, or the one argument "
            "its forward takes"
        )
        raise ValueError(
            f"seqckpt: validate(<your {what}>) needs sample=, a batch like the "
            f"training ones ({taken})."
        )
    if batch is not None:
        raise ValueError(
            f"seqckpt: batch={batch} sizes the embedded models' inputs; for your "
            f"{what} the sample sets the batch. Leave batch out."
        )
    if isinstance(sample, Mapping) and not isinstance(sample, dict):
        sample = dict(sample)  # (a tokenizer's BatchEncoding)
    x, dev = place(sample, device, model)
    # leaves of our own, so that your batch gets no gradients either
    x = replace_tensors(
        x, [t.detach().requires_grad_(t.requires_grad) for t in tensors_in(x)]
    )
    name = type(model).__name__
    if name == "OptimizedModule":  # torch.compile(model)
        name = f"{type(model._orig_mod).__name__} (compiled)"
    if chain:
        n = len(as_chain(model, "model"))
        k = max(1, round(math.sqrt(n))) if segments is None else segments
        if not 1 <= k <= n:
            raise ValueError(
                f"seqckpt: segments must be between 1 and {n} for your chain ({n} "
                f"modules), got {k}."
            )
        variants, shape = _chain_variants(k, n, policy)
    else:
        variants, shape = _whole_model_variants(model, name, segments, policy)
    if progress:
        print(f"seqckpt: validating your {name} on {dev} ...", file=sys.stderr)
    base = copy.deepcopy(model).to(dev)
    return _compare(name, base, x, dev, *variants, shape, repeats)


# How a variant is run: the forward of the plain copies, the forward of the
# checkpointed copy, and what turns a plain copy into the checkpointed one.
Variants = tuple[Forward, Forward, Callable[[nn.Module], nn.Module]]


def _shape(segments: int | None, blocks: int, policy: Policy | None) -> dict[str, Any]:
    """The row's ``segments``, ``blocks`` and ``policy``."""
    return {
        "segments": segments,
        "blocks": blocks,
        "policy": None if policy is None else str(policy),
    }


def _chain_variants(
    k: int, n: int, policy: Policy | None
) -> tuple[Variants, dict[str, Any]]:
    """A chain of ``n`` modules run module by module, and through
    checkpoint_sequential in ``k`` segments, keeping what ``policy`` says;
    the row's shape."""

    def plain(m: nn.Module, t: Any) -> Any:
        for layer in cast(nn.Sequential, m):  # (a ModuleList too: its calls)
            t = layer(t)
        return t

    def checkpointed(m: nn.Module, t: Any) -> Any:
        return checkpoint_sequential(cast(nn.Sequential, m), k, t, policy=policy)

    return (plain, checkpointed, _unchanged), _shape(k, n, policy)


def _unchanged(m: nn.Module) -> nn.Module:
    return m


def _call(model: nn.Module, x: Any) -> Any:
    """A whole model called on the sample: a dict as keywords (as HF models
    take a batch), a tuple as positional arguments, anything else as the one
    argument."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def _whole_model_variants(
    model: nn.Module, name: str, segments: int | None, policy: Policy | None
) -> tuple[Variants, dict[str, Any]]:
    """A whole model called plainly, and with its blocks checkpointed by
    :func:`~seqckpt.checkpoint_blocks` (on a copy), keeping what ``policy``
    says; the row's shape. Refused where that would checkpoint nothing."""
    if not model.training:
        raise ValueError(
            f"seqckpt: your {name} is in eval mode, where checkpointed blocks run "
            "plainly (as HF's and timm's own checkpointing do); call "
            "model.train() before validate."
        )

    def with_blocks(m: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said once, below
            return checkpoint_blocks(m, segments, policy=policy)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trial = checkpoint_blocks(copy.deepcopy(model), segments, policy=policy)
    blocks = sum(
        isinstance(m.__dict__.get("forward"), CheckpointedForward)
        for m in trial.modules()
    )
    if blocks == 0:
        raise ValueError(
            f"seqckpt: checkpoint_blocks finds no stack of repeated blocks in your "
            f"{name}, so validate would compare it with itself. Validate its "
            "trunk as a chain: seqckpt.validate(model.features, sample=...) for "
            "an nn.Sequential or nn.ModuleList of its layers."
        )
    for w in caught:  # what else checkpoint_blocks says (own checkpointing on)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return (_call, _call, with_blocks), _shape(segments, blocks, policy)


def place(
    sample: Any, device: str | None, chain: nn.Module
) -> tuple[Any, torch.device]:
    """``sample`` with its tensors on ``device``, and that device; None: where
    the sample's first tensor is, else where the chain's parameters are, else
    the CPU."""
    tensors = tensors_in(sample)
    if device is not None:
        dev = resolve_device(device)
    elif tensors:
        dev = tensors[0].device
    else:
        dev = next((p.device for p in chain.parameters()), torch.device("cpu"))
    return replace_tensors(sample, [t.to(dev) for t in tensors]), dev


def batch_of(x: Any) -> int | None:
    """The leading size of the sample's first tensor (None: no batch seen)."""
    tensors = tensors_in(x)
    return tensors[0].shape[0] if tensors and tensors[0].dim() else None


def _compare(
    name: str,
    model: nn.Module,
    x: Any,
    device: torch.device,
    plain: Forward,
    checkpointed: Forward,
    prepare: Callable[[nn.Module], nn.Module],
    shape: dict[str, Any],
    repeats: int,
) -> dict[str, Any]:
    """The row of ``validate`` for ``model`` on ``x``, plain and checkpointed
    (``prepare`` turns a copy into the checkpointed model); ``shape``: the
    row's ``segments``, ``blocks`` and ``policy``."""
    # Warm up on throwaway copies: the first cuBLAS / cuDNN calls allocate
    # workspaces that stay, which would otherwise count against whichever
    # variant is measured first.
    _step(copy.deepcopy(model), x, plain)
    _step(prepare(copy.deepcopy(model)), x, checkpointed)

    # One measured step each from identical state: memory and gradients. The
    # plain run twice, so that the difference the device's kernels make by
    # themselves is known (zero on the CPU and with deterministic algorithms).
    runs = {
        "plain": (copy.deepcopy(model), plain),
        "plain again": (copy.deepcopy(model), plain),
        "checkpointed": (prepare(copy.deepcopy(model)), checkpointed),
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
        gradients = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
        if gradients >= peaks["plain"] / 2:
            reason += (
                f" (the parameters' gradients, allocated in backward, take "
                f"{gradients / 2**20:.2f} of its {peaks['plain'] / 2**20:.2f} MiB: "
                "at this batch the activations checkpointing drops are a small "
                "share; a larger batch shows what it saves)"
            )
    return {
        "model": name,
        "device": str(device),
        **shape,
        "batch": batch_of(x),
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
    model: str | nn.Module = "all",
    device: str | None = None,
    segments: int | None = None,
    batch: int | None = None,
    progress: bool = False,
    *,
    sample: Any = None,
    policy: Any = None,
) -> list[dict[str, Any]]:
    """Validate checkpointing on the embedded models, or on your own chain or model.

    For each model, after a warm-up step of each variant on throwaway copies
    (the first cuBLAS and cuDNN calls allocate workspaces that stay), runs one
    training step plainly, a second plain one and one checkpointed (a chain
    with :func:`seqckpt.checkpoint_sequential`, a whole model with its blocks
    checkpointed by :func:`seqckpt.checkpoint_blocks`), all from the same
    weights and RNG seed, and reports peak memory (``seqckpt.track_memory``: allocated, and on
    CUDA reserved), the step-time ratio (median of ``3`` steps each) and whether
    gradients and buffers match. Gradients: bitwise on the CPU and with
    deterministic algorithms (see :func:`make_deterministic`), otherwise
    ``allclose(rtol=1e-4, atol=1e-6)`` or, per tensor, within 4x the
    difference between two plain runs (the device's own floor, also reported;
    see :func:`grads_close`). Buffers (BatchNorm
    statistics): always exactly. A step backpropagates the sum of the
    output's tensors that require grad.

    Args:
        model: a name from :data:`seqckpt.models.MODELS`, or ``"all"``; or your
            chain as an ``nn.Sequential`` or ``nn.ModuleList``, or your whole
            model as any other ``nn.Module`` (in training mode), with
            ``sample``. Yours is copied: it gets no gradients and is not moved
            (nor does your sample get any).
        device: ``"cpu"``, ``"cuda"`` or None (embedded models: CUDA when
            available; yours: where the sample is).
        segments: segment count; None uses each embedded model's default, and
            the square root of the length (rounded) for your chain; for your
            whole model, ``checkpoint_blocks``'s: None, every block its own
            region, or segments per ``nn.Sequential`` stack.
        batch: batch size of the embedded models; None uses their CPU or GPU
            default (your sample sets yours).
        progress: print a line per model on stderr.
        sample: a batch for your chain's first layer; for your whole model a
            dict of keywords (a tokenizer's output: ``model(**sample)``), a
            tuple of positional arguments, or the one argument (with a name:
            not taken).
        policy: what each checkpointed region keeps (see
            :func:`seqckpt.checkpoint`: ``"compute_heavy"``, aten ops,
            :func:`seqckpt.policies.names`, a callable); None keeps only
            the regions' inputs.

    Returns:
        One dict per model with keys ``model, device, segments, blocks,
        policy, batch, peak_mib_plain, peak_mib_checkpointed, reserved_mib_plain,
        reserved_mib_checkpointed, reduction_pct, time_ratio,
        max_abs_grad_diff, plain_vs_plain_max_abs_grad_diff, bitwise_equal,
        grad_rule, ok, reason``; ``model`` is your model's class name,
        ``blocks`` a chain's length or the number of blocks
        ``checkpoint_blocks`` checkpointed in your model.

    Raises:
        ValueError: unknown model, CUDA asked for without a GPU, segments out of
            range for a model, a batch below 1, your model without a sample (or
            a sample with a name, or a batch with yours), your whole model in
            eval mode or without a stack of blocks to checkpoint.
        TypeError: ``model`` neither a name nor a module, an output holding no
            tensor that requires grad.

    Example:
        >>> import torch, seqckpt
        >>> (row,) = seqckpt.validate("mlp", device="cpu")
        >>> row["bitwise_equal"], row["ok"], row["reduction_pct"] > 0
        (True, True, True)
        >>> chain = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(9)])
        >>> (row,) = seqckpt.validate(chain, sample=torch.randn(256, 64))
        >>> row["model"], row["segments"], row["bitwise_equal"], row["ok"]
        ('Sequential', 3, True, True)
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = torch.nn.ModuleList(
        ...             torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        ...             for _ in range(4))
        ...     def forward(self, x, scale=1.0):
        ...         for block in self.blocks:
        ...             x = block(x) * scale
        ...         return x
        >>> (row,) = seqckpt.validate(Net(), sample={"x": torch.randn(256, 64)})
        >>> row["model"], row["blocks"], row["bitwise_equal"], row["ok"]
        ('Net', 4, True, True)
    """
    chosen = as_policy(policy)  # (a bad policy fails before any run)
    if not isinstance(model, str):
        return [
            validate_yours(
                model, sample, device, segments, batch, progress, policy=chosen
            )
        ]
    if sample is not None:
        raise ValueError(
            f"seqckpt: sample= is for your own chain; the embedded model {model!r} "
            "makes its own (size it with batch=)."
        )
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
        rows.append(validate_one(name, dev, segments, batch, policy=chosen))
    return rows
