"""Plans that follow the input: one or two profiles, the plans of the whole
frontier, and for every batch shape the fastest stored plan that fits.

Batches of varying shape (sequence lengths, image sizes, packed batches) need
different plans: a short batch can keep everything, a long one must recompute.
Profiling every new shape costs several timed steps each; one plan made for the
longest shape recomputes far more than short batches need. A
:class:`Frontier` does neither:

- **Sizes.** A layer's bytes grow close to linearly with the number of
  elements of the chain's input, and its times close to linearly above a
  floor. The frontier profiles the chain at the first shape it sees and at the
  first one that differs by a tenth or more, fits each figure as a line
  through the two profiled sizes nearest (while there is one: bytes
  proportional to the size above it and its own below, times proportional),
  and predicts every other shape's profile. A size more than twice the
  largest profiled is profiled too: extrapolating a line upwards would miss
  what grows faster than linearly (an attention matrix). Where batches
  differ in both count and length (token-budget batching: 16x64 and 8x128
  tokens, one size), the size alone does not tell their bytes apart
  (attention weights hold batch x length²): a batch of another length than
  the profiles' is profiled too, and bytes are fitted on the size and the
  size times the length (see :func:`_fit`). Image sizes do not
  fit a line (strided layers round odd sizes up, see :func:`image_sizes`):
  ``segments="auto"`` keeps a frontier per image size, and a frontier made
  by hand warns when it is asked for another image size than its profile's.
- **Plans.** One solve gives the fastest plan for every budget up to the
  keep-everything peak (the solver's table holds all of them); those plans are
  stored. For a batch, the fastest stored plan whose predicted peak at that
  batch's size fits the budget is run, without profiling or solving again.
  Only when no stored plan fits does the batch's size class (sizes within a
  factor of two) add its own frontier, from its predicted profile (once per
  class; beyond that, an exact solve for the batch).
- **Checks.** :meth:`Frontier.observe` takes a measured peak; when it is more
  than ``tolerance`` (10%) away from the prediction, the next batch of that
  size is profiled again and the fit uses it. ``segments="auto"`` on CUDA
  measures the first step of each size class itself (allocator counters, from
  the chain's forward to the end of that backward) and calls it.
- **Never over budget.** Plans are chosen with a predicted peak within
  ``1 - HEADROOM`` (99%) of the budget, a margin for the predictions' error
  (measured at well under 1% on the GPT-style chain). When none fits,
  ``PlanError`` names the smallest budget that would, before anything runs.

Example:
    >>> import torch, seqckpt
    >>> chain = torch.nn.Sequential(
    ...     *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    ...       for _ in range(6)])
    >>> frontier = seqckpt.plan(chain, torch.randn(32, 64), frontier=True)
    >>> small, large = torch.randn(8, 64), torch.randn(64, 64)
    >>> frontier.plan_for(small, "100KiB").checkpoints()  # everything fits
    0
    >>> frontier.plan_for(large, "100KiB").checkpoints() > 0  # no new profile
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from seqckpt._tree import tensors_in
from seqckpt.planner.budget import format_bytes, parse_budget
from seqckpt.planner.cost import CostModel
from seqckpt.planner.profile import ChainProfile, PolicyCost
from seqckpt.planner.solver import (
    DEFAULT_SLOTS,
    EXACT_LAYERS,
    fastest_plan,
    frontier_plans,
    smallest_peak,
)
from seqckpt.planner.tree import Plan, PlanError, Run, check_format, load_json

__all__ = ["Frontier", "image_sizes", "input_batch", "input_size"]

_BYTES = (
    "input_bytes",
    "output_bytes",
    "saved_bytes",
    "held_bytes",
    "forward_peak_bytes",
    "nograd_peak_bytes",
    "backward_peak_bytes",
    "region_kept_bytes",
    "region_cast_bytes",
    "shared_grad_bytes",
)
_TIMES = ("forward_time", "backward_time")
# A time predicted for a smaller size never drops below this share of the
# smallest measured one (launch and Python overheads do not shrink).
_TIME_FLOOR = 0.25
# While one size is profiled, a size differing by this factor is profiled too.
_SECOND_PROFILE = 1.1
# A size this far beyond the profiled ones is profiled where bytes grow
# faster than the size (above: twice the largest otherwise).
_BEYOND_SUPERLINEAR = 1.25
# Share of the budget kept free of predicted bytes, for prediction error.
HEADROOM = 0.01
# Bytes per element rising by more than this between two profiled sizes
# count as growing faster than the size. A line through two sizes, N and 2N,
# extrapolated to 4N under-predicts bytes whose share per element rises by r
# between them by about 1.4 r: that must stay within HEADROOM. (At 1.02, six
# timm ViT-Tiny blocks with attention written out, profiled at 4x16 and 4x32
# tokens, were not flagged and 4x64 was predicted at 0.980 of its bytes.)
_FASTER = 1.005
# A batch as a frontier reads it: (input_size, input_batch).
Shape = tuple[int, int | None]


def input_size(input: Any) -> int:
    """The size a frontier keys on: the number of elements of the input's
    tensors (batch x sequence x width for a language model's activations)."""
    return sum(t.numel() for t in tensors_in(input))


def input_batch(input: Any) -> int | None:
    """The batch a frontier reads lengths with: the first dimension of the
    input's first tensor of rank two or more (None where there is none, or it
    is empty; batch-first layouts, as HF's, timm's and torchvision's). The
    input's size over its batch is the size of one sample (a sequence's length
    times its width): batches of one size hold different bytes at different
    lengths where attention keeps its softmax weights (batch x length²)."""
    for t in tensors_in(input):
        if t.dim() >= 2:
            return int(t.shape[0]) if t.numel() else None
    return None


def image_sizes(input: Any) -> tuple[tuple[int, ...], ...]:
    """Per tensor of ``input``, its sizes after the first two dimensions where
    it is floating point and of rank three or more (an image's height and
    width, a signal's length), else (). Strided convolutions and pooling round
    these up at every stage, so a layer's bytes are not linear in the input's
    element count across them: torchvision's mobilenet_v2 and efficientnet_b0
    at 72x72 hold 5.5% and 8% more than their 64x64 profiles scaled by the
    element count, and a frontier fitted across image sizes ran steps up to
    17% over the budget. Batch and sequence dimensions (the first two) scale
    layers linearly."""
    return tuple(
        tuple(t.shape[2:]) if t.dim() >= 3 and t.is_floating_point() else ()
        for t in tensors_in(input)
    )


def _line(x: float, points: list[tuple[int, float]]) -> float:
    """The value at ``x`` of the line through the two points around it, or
    outside them the two nearest in size (through the origin with one
    point). Between profiled sizes, the points around ``x`` (not merely the
    two nearest, which can both lie on one side) keep a convex growth under
    the line: with sizes 100, 128 and 256, 140 is read on 128-256."""
    if len(points) == 1:
        (x0, y0) = points[0]
        return y0 * x / x0
    below = [p for p in points if p[0] <= x]
    above = [p for p in points if p[0] >= x]
    if below and above:
        (x0, y0), (x1, y1) = max(below), min(above)
    else:
        (x0, y0), (x1, y1) = sorted(points, key=lambda p: abs(p[0] - x))[:2]
    if x0 == x1:
        return y0
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _bytes_at(x: int, points: list[tuple[int, float]]) -> int:
    """Bytes at ``x``: on the line through the two profiled sizes nearest,
    and with one, proportional above it but never below its value. Scaled down
    with the input, what does not shrink with it (the weights' casts autocast
    caches, weight-sized gradient temporaries) was predicted too small: eight
    GPT blocks under bf16 autocast, profiled at 4x32 tokens and planned for
    3x32, ran 1.17x their budget."""
    if len(points) == 1:
        ((x0, y0),) = points
        return math.ceil(y0 * max(1.0, x / x0))
    (x0, y0), (x1, y1) = sorted(points)[:2]
    if x < x0 and y1 * x0 > y0 * x1:
        # growing faster than the size there, the line below the smallest
        # profiled size falls under the bytes: that size's bytes bound them
        return math.ceil(y0)
    return max(0, math.ceil(_line(x, points)))


def _seconds_at(x: int, points: list[tuple[int, float]]) -> float:
    return max(_TIME_FLOOR * min(y for _, y in points), _line(x, points))


class _Fit(NamedTuple):
    """How a batch's figures are predicted from the profiles (see
    :func:`_fit`): on the lines in the size through the profiles ``lines``
    (:func:`_bytes_at`), as the sum of the profiles' figures times
    ``weights`` ((profile, weight) pairs), or, with both, bytes as the larger
    of the two and times on the lines."""

    lines: tuple[int, ...] = ()
    weights: tuple[tuple[int, float], ...] = ()


def _predict(
    points: list[tuple[int, ChainProfile]], size: int, fit: _Fit
) -> ChainProfile:
    """Every figure of every layer at ``size``, from the measured profiles."""

    def bytes_at(values: list[int]) -> int:
        found = []
        if fit.lines:
            found.append(
                _bytes_at(size, [(points[k][0], values[k]) for k in fit.lines])
            )
        if fit.weights:
            weighted = sum(w * values[k] for k, w in fit.weights)
            found.append(max(0, math.ceil(weighted)))
        return max(found)

    def seconds_at(values: list[float]) -> float:
        if fit.lines:
            return _seconds_at(size, [(points[k][0], values[k]) for k in fit.lines])
        weighted = sum(w * values[k] for k, w in fit.weights)
        return max(_TIME_FLOOR * min(values[k] for k, _ in fit.weights), weighted)

    layers = []
    template = points[0][1]
    for k, layer in enumerate(template.layers):
        at = [p.layers[k] for _, p in points]
        values: dict[str, Any] = {
            field: bytes_at([getattr(m, field) for m in at]) for field in _BYTES
        }
        for field in _TIMES:
            values[field] = seconds_at([getattr(m, field) for m in at])
        costs = tuple(
            PolicyCost(
                cost.policy,
                bytes_at([m.policies[q].kept_bytes for m in at]),
                seconds_at([m.policies[q].recompute_time for m in at]),
                cost.keeps_output,
                seconds_at([m.forward_time_under(m.policies[q]) for m in at]),
                bytes_at([m.policies[q].cast_bytes for m in at]),
            )
            for q, cost in enumerate(layer.policies)
        )
        layers.append(dataclasses.replace(layer, **values, policies=costs))
    return dataclasses.replace(template, layers=tuple(layers))


def _shape(input: Any, batch: int | None) -> Shape:
    """(size, batch) of a batch, or of a size given with its batch."""
    if isinstance(input, int):
        return input, batch
    return input_size(input), input_batch(input)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _lengths(shapes: Sequence[Shape]) -> list[float] | None:
    """Each profile's length (its size per sample), or None where some
    profile's batch is unknown."""
    if any(b is None for _, b in shapes):
        return None
    return [x / b for x, b in shapes if b is not None]


def _fit(shapes: Sequence[Shape], size: int, batch: int | None) -> _Fit:
    """How the profiles (at ``shapes``) predict the figures of a batch of
    ``size`` elements and ``batch`` samples.

    A figure is taken as c + a*size + b*size*length, where length is the size
    of one sample: attention that keeps its softmax weights holds
    batch x length² = size x length elements. Profiles of one length (a
    growing batch), or of unknown counts: the lines in the size. Profiles of
    several lengths at one size (within a tenth; token-budget batching: 16x64
    and 8x128 tokens): at that size, the line in size x length through the
    two nearest; at another size, the lines through the profile of the
    nearest length. Otherwise the plane through the three profiles whose
    weights are smallest (at most one in all between them); where all the
    profiles share one count, bytes take the larger of the plane and the
    lines in the size (a curve through three sizes can dip under a convex
    growth that is not a square, as sliding-window attention's, between them;
    the lines there cannot), and times the lines."""
    everyone = tuple(range(len(shapes)))
    lengths = _lengths(shapes)
    if batch is None or lengths is None or all(_same(n, lengths[0]) for n in lengths):
        return _Fit(lines=everyone)
    sizes = [x for x, _ in shapes]
    length = size / batch
    if max(size, *sizes) < _SECOND_PROFILE * min(size, *sizes):  # one size
        q = [x * n for x, n in zip(sizes, lengths, strict=True)]
        nearest = sorted(everyone, key=lambda k: abs(q[k] - length * size))
        i = nearest[0]
        j = next((k for k in nearest if not _same(q[k], q[i])), None)
        if j is None:
            return _Fit(lines=(i,))
        t = (size * length - q[i]) / (q[j] - q[i])
        return _Fit(weights=((i, 1 - t), (j, t)))
    if max(sizes) < _SECOND_PROFILE * min(sizes):  # another size than the profiles'
        return _Fit(
            lines=(min(everyone, key=lambda k: abs(math.log(lengths[k] / length))),)
        )
    # the plane, in sizes and size x length relative to the query's
    u = [x / size for x in sizes]
    v = [x * n / (size * length) for x, n in zip(sizes, lengths, strict=True)]
    best: tuple[float, tuple[tuple[int, float], ...]] | None = None
    near = sorted(everyone, key=lambda k: math.log(u[k]) ** 2 + math.log(v[k]) ** 2)
    for i, j, k in itertools.combinations(near[:8], 3):
        d = (u[j] - u[i]) * (v[k] - v[i]) - (u[k] - u[i]) * (v[j] - v[i])
        if abs(d) < 1e-9:
            continue
        wj = ((1 - u[i]) * (v[k] - v[i]) - (u[k] - u[i]) * (1 - v[i])) / d
        wk = ((u[j] - u[i]) * (1 - v[i]) - (1 - u[i]) * (v[j] - v[i])) / d
        score = abs(1 - wj - wk) + abs(wj) + abs(wk)
        if best is None or score < best[0]:
            best = (score, ((i, 1 - wj - wk), (j, wj), (k, wk)))
    if best is None:
        return _Fit(lines=everyone)
    one_count = all(b == shapes[0][1] for _, b in shapes)
    return _Fit(lines=everyone if one_count else (), weights=best[1])


def _superlinear(low: tuple[int, ChainProfile], high: tuple[int, ChainProfile]) -> bool:
    """Whether some byte figure of some layer grows faster than the size
    between two profiled sizes (bytes per element rising by more than
    ``_FASTER``)."""
    (x0, small), (x1, large) = low, high
    return any(
        getattr(b, field) * x0 > _FASTER * getattr(a, field) * x1
        for a, b in zip(small.layers, large.layers, strict=True)
        for field in _BYTES
    )


def _size_class(size: int) -> int:
    return max(0, int(math.log2(max(1, size))))


_SERIALS = itertools.count()


class Frontier:
    """The plans of a chain for every budget and every input size.

    Made by ``seqckpt.plan(modules, sample, frontier=True)`` (or used inside
    ``segments="auto"``). :meth:`plan_for` gives the plan for a batch and a
    budget; :meth:`needs_profile` tells whether a batch of that size should be
    profiled (then :meth:`add_profile`); :meth:`observe` checks a measured
    peak. :meth:`to_json` / :meth:`from_json` save and load it.

    Attributes:
        points: the measured profiles, as (input size, profile).
        batches: the :func:`input_batch` of each profile (None where
            unknown: then lengths are not told apart, see :func:`_fit`).
        plans: the stored candidate plans.
        tolerance: how far (a share) a measured peak may be from the
            prediction before that size is profiled again.
        images: the :func:`image_sizes` of the batch it was profiled with
            (None where unknown): :meth:`plan_for` warns once per other
            image size it is given, whose prediction the fit does not hold.
    """

    def __init__(
        self,
        points: Sequence[tuple[int, ChainProfile]],
        *,
        slots: int = DEFAULT_SLOTS,
        tolerance: float = 0.10,
        plans: Sequence[Plan] = (),
        images: tuple[tuple[int, ...], ...] | None = None,
        batches: Sequence[int | None] | None = None,
    ) -> None:
        if not points:
            raise ValueError("seqckpt: a frontier needs at least one profile.")
        self.points = list(points)
        self.batches = [None] * len(self.points) if batches is None else list(batches)
        if len(self.batches) != len(self.points):
            raise ValueError(
                f"seqckpt: batches has {len(self.batches)} entries for "
                f"{len(self.points)} profiles; give one per profile (or None)."
            )
        self.serial = next(_SERIALS)  # tells frontiers apart in plan caches
        self.images = images
        self._warned: set[tuple[tuple[int, ...], ...]] = set()
        self.slots = slots
        self.tolerance = tolerance
        self.plans: list[Plan] = list(plans)
        # The plans counted so far, and their CostModel.linear_counts as two
        # matrices (time counts, floor counts), a row per plan.
        self._counted: list[Plan] = []
        self._matrices: tuple[torch.Tensor, torch.Tensor] | None = None
        self._classes: set[int] = set()
        self._predictions: dict[Shape, tuple[ChainProfile, CostModel]] = {}
        self._stale: set[int] = set()
        self._checked: set[tuple[int, int]] = set()
        # whether bytes grow faster than the size between the two smallest
        # and between the two largest profiled sizes, and from the shortest
        # length to the longest (see needs_profile, _new_length)
        self._growth: tuple[bool, bool] | None = None
        self._length_growth: bool | None = None
        self.solves = 0

    def __len__(self) -> int:
        return len(self.points[0][1])

    def __repr__(self) -> str:
        sizes = ", ".join(str(x) for x, _ in self.points)
        return (
            f"Frontier({len(self)} layers, profiled at sizes {sizes}, "
            f"{len(self.plans)} plans)"
        )

    # ------------------------------------------------------------ predictions

    def profile_at(self, size: int, batch: int | None = None) -> ChainProfile:
        """The predicted profile for an input of ``size`` elements (in
        ``batch`` samples, where known: see :func:`input_batch`)."""
        return self._predicted(size, batch)[0]

    def _model(self, size: int, batch: int | None = None) -> CostModel:
        return self._predicted(size, batch)[1]

    def _predicted(
        self, size: int, batch: int | None
    ) -> tuple[ChainProfile, CostModel]:
        found = self._predictions.get((size, batch))
        if found is None:
            if len(self._predictions) > 256:
                self._predictions.clear()
            fit = _fit(self._shapes(), size, batch)
            profile = _predict(self.points, size, fit)
            found = self._predictions[(size, batch)] = (profile, CostModel.of(profile))
        return found

    def _shapes(self) -> list[Shape]:
        return [(x, b) for (x, _), b in zip(self.points, self.batches, strict=True)]

    def needs_profile(self, size: int, batch: int | None = None) -> bool:
        """Whether a batch of ``size`` elements (in ``batch`` samples, where
        known) should be profiled: while only one size is profiled (within a
        tenth), the first that differs by a tenth or more (with one profile, a
        smaller size is predicted at that profile's bytes: safe, but up to a
        third too high at 0.75x, where a second profile gives the line); a
        size more than twice the largest profiled; where the chain's bytes grow
        faster than its size (an attention matrix), one more than a quarter
        beyond the profiled sizes, above or below (a line through two points
        misses that growth outside them: softmax-attention blocks profiled at
        40 and 64 tokens ran 120 tokens at 1.23x the budget, profiled at 86 and
        96, 40 tokens at 1.56x); a size whose measured peak drifted from its
        prediction; and a new length (see :meth:`_new_length`). Other sizes
        are predicted: between two profiled sizes on the line (above a convex
        growth: on the safe side), below the smallest on the line, or at the
        smallest's bytes where they grow faster than the size there (not
        across image sizes, whose rounding is not convex: keep those apart)."""
        if _size_class(size) in self._stale:
            return True
        sizes = [x for x, _ in self.points]
        low, high = min(sizes), max(sizes)
        one_size = high < _SECOND_PROFILE * low
        if one_size and max(size, high) >= _SECOND_PROFILE * min(size, low):
            return True
        if self._new_length(size, batch):
            return True
        if one_size:
            return False
        if self._growth is None:  # (at the smallest sizes, at the largest)
            ordered = sorted(self.points, key=lambda p: p[0])
            self._growth = (_superlinear(*ordered[:2]), _superlinear(*ordered[-2:]))
        if size < low and self._growth[0]:
            return size * _BEYOND_SUPERLINEAR < low
        if self._growth[1] and len(sizes) == 2 and size > high:
            return True  # a line through two sizes: a third gives the curve
        return size > (_BEYOND_SUPERLINEAR if self._growth[1] else 2) * high

    def _new_length(self, size: int, batch: int | None) -> bool:
        """Whether a batch's length (its size per sample) is one the profiles
        do not cover: where they all share a length, another one; where they
        all share a batch, another batch (at one size, a longer sequence holds
        more attention bytes: eight softmax-attention blocks profiled at 16x64
        tokens ran 8x128 at 1.36x the budget and 4x256 at 2.42x before
        2026-12-07's eighth session); where they span both, a length more than
        a quarter beyond theirs where bytes per element grow with the length
        (from the shortest profiled to the longest), else more than twice
        (see :func:`_fit`). Unknown batches: False."""
        lengths = _lengths(self._shapes())
        if batch is None or lengths is None:
            return False
        length = size / batch
        one_length = all(_same(n, lengths[0]) for n in lengths)
        one_batch = all(b == self.batches[0] for b in self.batches)
        if (one_length and _same(length, lengths[0])) or (
            one_batch and batch == self.batches[0]
        ):
            return False
        if one_length or one_batch:
            return True
        if self._length_growth is None:
            ordered = sorted(zip(lengths, self.points, strict=True), key=lambda p: p[0])
            self._length_growth = _superlinear(ordered[0][1], ordered[-1][1])
        beyond = _BEYOND_SUPERLINEAR if self._length_growth else 2
        return not (min(lengths) <= beyond * length and length <= beyond * max(lengths))

    def add_profile(
        self, size: int, profile: ChainProfile, batch: int | None = None
    ) -> None:
        """Use a profile measured at ``size`` (in ``batch`` samples, where
        known) for the predictions."""
        if len(profile) != len(self):
            raise PlanError(
                f"seqckpt: profile has {len(profile)} layers, the frontier "
                f"{len(self)}; profile the same chain."
            )
        kept = [
            (point, b)
            for point, b in zip(self.points, self.batches, strict=True)
            if (point[0], b) != (size, batch)
        ]
        self.points = [point for point, _ in kept] + [(size, profile)]
        self.batches = [b for _, b in kept] + [batch]
        self._stale.discard(_size_class(size))
        self._predictions.clear()
        self._growth = self._length_growth = None
        # The stored plans stay: the new fit ranks them at every size.

    def first_of_class(self, size: int, batch: int | None = None) -> bool:
        """True the first time it is asked about a size class (sizes within a
        factor of two; with batches known, per class of batch too):
        ``segments="auto"`` measures that step's peak for :meth:`observe`,
        once per class."""
        size_class = (_size_class(size), -1 if batch is None else _size_class(batch))
        if size_class in self._checked:
            return False
        self._checked.add(size_class)
        return True

    def observe(
        self, input: Any, peak_bytes: int, plan: Plan, batch: int | None = None
    ) -> bool:
        """Compare a step's measured peak with ``plan``'s prediction at this
        input's size (a batch, or its size in elements and ``batch``);
        returns True (and marks the size for a profile) when they are more
        than ``tolerance`` apart."""
        size, batch = _shape(input, batch)
        predicted, _ = self._model(size, batch).total(plan.items)
        drifted = abs(peak_bytes - predicted) > self.tolerance * max(1, predicted)
        if drifted:
            self._stale.add(_size_class(size))
        return drifted

    # ------------------------------------------------------------------ plans

    def plan_for(self, input: Any, budget: int | str, batch: int | None = None) -> Plan:
        """The fastest stored plan whose predicted peak for ``input`` (a batch,
        or its size in elements and ``batch``, its :func:`input_batch`) fits
        ``budget``: keeping every activation when that fits (no plan is
        faster). Where no stored plan fits, the input's size class adds its
        frontier (once), else an exact solve gives the plan. Raises
        ``PlanError`` naming the smallest budget that would fit when none
        does."""
        size, batch = _shape(input, batch)
        if not isinstance(input, int):
            self._check_image_size(image_sizes(input))
        given = parse_budget(budget)
        limit = int(given * (1 - HEADROOM))
        model = self._model(size, batch)
        everything = (Run(0, len(model)),)
        need, seconds = model.total(everything)
        if need <= limit:  # nothing is faster than keeping every activation
            return Plan(everything, need, seconds)
        best = self._fastest_fitting(model, limit)
        if best is None and _size_class(size) not in self._classes:
            self._add_plans(size, batch, model)
            best = self._fastest_fitting(model, limit)
        if best is None:
            floor = self._floor(size, batch)
            if floor <= limit:  # between the stored plans' steps: solve exactly
                found = fastest_plan(self.profile_at(size, batch), limit, self.slots)
                self.plans.append(Plan(found.items))
                return found
            needed = math.ceil(floor / (1 - HEADROOM))
            raise PlanError(
                f"seqckpt: memory_budget={given} bytes ({format_bytes(given)}) is "
                f"below what the smallest plan for an input of {size} elements "
                f"needs: {needed} bytes ({format_bytes(needed)}, its predicted "
                f"peak plus {HEADROOM:.0%} headroom); give at least that, or a "
                "smaller batch."
            )
        return best

    def _fastest_fitting(self, model: CostModel, limit: int) -> Plan | None:
        """The fastest stored plan whose peak under ``model`` is within
        ``limit``: the plans are ranked by their predicted time, and peaks
        are computed in that order, skipping those whose floor is already
        over the limit, until one fits (see :meth:`CostModel.linear_counts`)."""
        if not self.plans:
            return None
        time_counts, floor_counts = self._linear_counts(model)
        time_terms, byte_terms = model.linear_terms()
        times = time_counts @ torch.tensor(time_terms, dtype=torch.float64)
        floors = (floor_counts @ torch.tensor(byte_terms, dtype=torch.float64)).tolist()
        for index in torch.argsort(times, stable=True).tolist():
            if floors[index] > limit:
                continue
            need, seconds = model.total(self.plans[index].items)
            if need <= limit:
                return Plan(self.plans[index].items, need, seconds)
        return None

    def _linear_counts(self, model: CostModel) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored plans' time and floor counts as two matrices, one row per
        plan; rows are added as plans are (and all remade if the list of
        plans was changed otherwise)."""
        counted = self._counted
        if len(counted) > len(self.plans) or any(
            a is not b for a, b in zip(counted, self.plans, strict=False)
        ):
            counted, self._matrices = [], None
        new = self.plans[len(counted) :]
        if new:
            rows = [model.linear_counts(plan.items) for plan in new]
            times = torch.tensor([r[0] for r in rows], dtype=torch.float64)
            floors = torch.tensor([r[1] for r in rows], dtype=torch.float64)
            if self._matrices is not None:
                times = torch.cat((self._matrices[0], times))
                floors = torch.cat((self._matrices[1], floors))
            self._counted, self._matrices = [*counted, *new], (times, floors)
        assert self._matrices is not None  # the caller has plans
        return self._matrices

    def _add_plans(self, size: int, batch: int | None, model: CostModel) -> None:
        n = len(model)
        top = model.total((Run(0, n),))[0]
        if n > EXACT_LAYERS:  # long chains: a few budgets on groups of layers
            profile = self.profile_at(size, batch)
            plans = []
            for eighths in range(2, 9):
                try:
                    plans.append(fastest_plan(profile, int(top * eighths / 8)))
                except PlanError:
                    continue
        else:
            plans = frontier_plans(model, top, self.slots)
        self.solves += 1
        plans.append(Plan((Run(0, n),)))  # the slots' rounding may leave it out
        known = {p.items for p in self.plans}
        for p in plans:
            if p.items not in known:
                known.add(p.items)
                self.plans.append(Plan(p.items))
        self._classes.add(_size_class(size))

    def _floor(self, size: int, batch: int | None) -> int:
        floor, plan = smallest_peak(self.profile_at(size, batch))
        if plan.items not in {p.items for p in self.plans}:
            self.plans.append(Plan(plan.items))
        return floor

    def _check_image_size(self, images: tuple[tuple[int, ...], ...]) -> None:
        if (
            self.images is None
            or images == self.images
            or not any(images)
            or images in self._warned
        ):
            return
        self._warned.add(images)
        warnings.warn(
            f"seqckpt: this frontier was profiled at image size {self.images} and "
            f"is asked to plan for {images}; its peaks are fitted as lines in the "
            "element count, which strided layers do not follow across image sizes "
            "(steps ran up to 17% over the budget on torchvision convnets). Make "
            "a frontier per image size (seqckpt.plan(..., frontier=True) with a "
            "batch of that size), or use segments='auto', which does.",
            stacklevel=3,
        )

    # ------------------------------------------------------------------- JSON

    def to_json(self) -> str:
        """The frontier as JSON: its profiles and stored plans."""
        return json.dumps(
            {
                "format": "seqckpt.frontier/1",
                "slots": self.slots,
                "tolerance": self.tolerance,
                "points": [[x, p.to_dict()] for x, p in self.points],
                "batches": self.batches,
                "plans": [p.to_dict() for p in self.plans],
                "images": None if self.images is None else list(self.images),
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: str) -> Frontier:
        """Read a frontier written by :meth:`to_json`."""
        return load_json(text, "frontier", Frontier._from_dict)

    @staticmethod
    def _from_dict(data: dict[str, Any]) -> Frontier:
        check_format(data, "seqckpt.frontier/1", "frontier")
        return Frontier(
            [(int(x), ChainProfile.from_dict(p)) for x, p in data["points"]],
            slots=int(data["slots"]),
            tolerance=float(data["tolerance"]),
            plans=[Plan.from_dict(p) for p in data["plans"]],
            images=(
                None
                if data.get("images") is None
                else tuple(tuple(int(n) for n in t) for t in data["images"])
            ),
            batches=[None if b is None else int(b) for b in data.get("batches") or []]
            or None,
        )


BudgetSource = int | str | Callable[[], int]


def budget_now(budget: BudgetSource) -> int:
    """The budget in bytes now: a callable is called (per step)."""
    if callable(budget):
        value = budget()
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                "seqckpt: a callable memory_budget must return bytes as an int, "
                f"got {value!r}."
            )
        return parse_budget(value)
    return parse_budget(budget)
