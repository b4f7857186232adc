"""Synthetic chain profiles for solver and cost-model tests (no timing noise)."""

from __future__ import annotations

from collections.abc import Sequence

from seqckpt.planner import ChainProfile, LayerProfile


def layer(
    act: int,
    f: float = 1.0,
    b: float = 2.0,
    *,
    saved: int | None = None,
    region_kept: int = 0,
    region_cast: int = 0,
    input_held: bool = True,
    output_held: bool = True,
    returns_input: bool = False,
    shared_grad: int = 0,
) -> LayerProfile:
    """A layer whose output is ``act`` bytes, keeping ``saved`` (default ``act``),
    and ``region_kept`` when recomputed until its recompute, besides
    ``region_cast`` until the forward ends (autocast's casts); ``input_held``,
    ``output_held``, ``returns_input`` and ``shared_grad`` (its
    ``shared_grad_bytes``) as :class:`LayerProfile` has them."""
    kept = act if saved is None else saved
    return LayerProfile(
        name="synthetic",
        forward_time=f,
        backward_time=b,
        input_bytes=act,
        output_bytes=act,
        saved_bytes=kept,
        held_bytes=kept,
        forward_peak_bytes=kept,
        nograd_peak_bytes=act,
        backward_peak_bytes=2 * act,
        region_kept_bytes=region_kept + region_cast,
        region_cast_bytes=region_cast,
        input_held=input_held,
        output_held=output_held,
        returns_input=returns_input,
        shared_grad_bytes=shared_grad,
    )


def chain_profile(layers: Sequence[LayerProfile]) -> ChainProfile:
    return ChainProfile(tuple(layers), "cpu")


def equal_layers(n: int, act: int = 1000) -> ChainProfile:
    return chain_profile([layer(act) for _ in range(n)])
