"""Planning long chains: adjacent cheap layers merged into groups, the exact
dynamic program solved on the groups, the plan expanded back to layers.

The dynamic program costs about ``n^3 * slots`` operations; past a few hundred
layers that is minutes. Merging the adjacent pair of layers whose forward and
backward take the least time, again and again until ``groups`` remain, keeps
the expensive layers apart (where the choice matters most) and gives the
solver a chain it plans in about a second. The plan it finds is one the exact
solver could have found too (a group is kept or recomputed whole), so it is
never faster than the exact optimum; ``bench/README.md`` gives the measured
loss.
"""

from __future__ import annotations

from dataclasses import replace

from seqckpt.planner.profile import ChainProfile, LayerProfile, PolicyCost
from seqckpt.planner.tree import Item, Plan, Recompute, Run

__all__ = ["coarsen", "expand"]


def _group_bounds(profile: ChainProfile, groups: int) -> list[int]:
    """Start index of each group: adjacent groups with the smallest combined
    step time are merged until ``groups`` remain."""
    steps = [p.forward_time + p.backward_time for p in profile.layers]
    starts = list(range(len(steps)))
    while len(steps) > groups:
        k = min(range(len(steps) - 1), key=lambda i: steps[i] + steps[i + 1])
        steps[k : k + 2] = [steps[k] + steps[k + 1]]
        del starts[k + 1]
    return starts


def _merge_layers(layers: tuple[LayerProfile, ...], can_start: bool) -> LayerProfile:
    """One profile for consecutive layers run as a unit: times add up, the
    peaks are those of running them in turn, keeping each one's saved bytes."""
    before = 0  # saved bytes of the members before the current one
    forward_peak = nograd_peak = backward_need = 0
    for k, p in enumerate(layers):
        forward_peak = max(forward_peak, before + p.forward_peak_bytes)
        nograd_peak = max(
            nograd_peak, (p.input_bytes if k else 0) + p.nograd_peak_bytes
        )
        backward_need = max(
            backward_need, before + p.held_bytes + p.backward_peak_bytes
        )
        if k < len(layers) - 1:
            before += p.saved_bytes
    held = before + layers[-1].held_bytes
    policies = tuple(
        PolicyCost(
            cost.policy,
            sum(p.policies[q].kept_bytes for p in layers),
            sum(p.policies[q].recompute_time for p in layers),
            layers[-1].policies[q].keeps_output,
            sum(p.forward_time_under(p.policies[q]) for p in layers),
            sum(p.policies[q].cast_bytes for p in layers),
        )
        for q, cost in enumerate(layers[0].policies)
    )
    return LayerProfile(
        name=f"{layers[0].name}..{layers[-1].name}"
        if len(layers) > 1
        else layers[0].name,
        forward_time=sum(p.forward_time for p in layers),
        backward_time=sum(p.backward_time for p in layers),
        input_bytes=layers[0].input_bytes,
        output_bytes=layers[-1].output_bytes,
        saved_bytes=before + layers[-1].saved_bytes,
        held_bytes=held,
        forward_peak_bytes=forward_peak,
        nograd_peak_bytes=nograd_peak,
        backward_peak_bytes=max(0, backward_need - held),
        region_kept_bytes=sum(p.region_kept_bytes for p in layers),
        region_cast_bytes=sum(p.region_cast_bytes for p in layers),
        input_held=layers[0].input_held,
        output_held=layers[-1].output_held,
        modifies_input=not can_start,
        returns_input=False,
        policies=policies,
        # (the most any member's backward holds: on the safe side)
        shared_grad_bytes=max(p.shared_grad_bytes for p in layers),
    )


def coarsen(
    profile: ChainProfile, groups: int, can_start: list[bool]
) -> tuple[ChainProfile, list[int]]:
    """The profile of at most ``groups`` groups of adjacent layers, and where
    each group starts. ``can_start[k]``: a recomputed stretch may begin at
    layer ``k`` (a group may begin only where its first layer can)."""
    starts = _group_bounds(profile, groups)
    bounds = [*starts, len(profile)]
    merged = tuple(
        _merge_layers(profile.layers[a:b], can_start[a])
        for a, b in zip(bounds, bounds[1:])  # noqa: B905
    )
    return replace(profile, layers=merged), starts


def expand(plan: Plan, starts: list[int], n: int) -> Plan:
    """A plan over groups as the same plan over the ``n`` layers."""
    bounds = [*starts, n]
    return Plan(_expand_items(plan.items, bounds))


def _expand_items(items: tuple[Item, ...], bounds: list[int]) -> tuple[Item, ...]:
    out: list[Item] = []
    for item in items:
        start, stop = bounds[item.start], bounds[item.stop]
        if isinstance(item, Run):
            out.append(Run(start, stop))
        else:
            inner = Plan(_expand_items(item.inner.items, bounds))
            out.append(Recompute(start, stop, inner, item.policy))
    return tuple(out)
