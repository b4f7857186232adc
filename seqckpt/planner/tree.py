"""The plan: a tree saying, for each layer of a chain, whether its activations are
kept or recomputed, and how a recomputed stretch is itself run when recomputed.

Every schedule is a plan: ``k`` uniform segments, explicit segment sizes, the
planner's optimum. One executor (:func:`seqckpt.executor.run_plan`) runs them all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from seqckpt.policies import Policy


class PlanError(ValueError):
    """A plan that cannot be built or does not fit the chain it is used with."""


@dataclass(frozen=True)
class Run:
    """Layers ``start`` to ``stop - 1`` run plainly; autograd keeps their activations."""

    start: int
    stop: int


@dataclass(frozen=True)
class Recompute:
    """Layers ``start`` to ``stop - 1`` run as one checkpoint: forward keeps only
    their input (and, with a ``policy``, the results it selects, see
    :mod:`seqckpt.policies`); backward runs them again following ``inner``, which
    may keep some layers and checkpoint others (nested recomputation)."""

    start: int
    stop: int
    inner: Plan
    policy: Policy | None = None


Item = Run | Recompute


@dataclass(frozen=True)
class Plan:
    """A schedule for layers ``items[0].start`` to ``items[-1].stop - 1``.

    Attributes:
        items: contiguous :class:`Run` and :class:`Recompute` items.
        predicted_peak_bytes: the planner's prediction, when it made the plan.
        predicted_time: the planner's predicted step time in seconds, likewise.

    Example:
        >>> from seqckpt.planner import uniform_plan
        >>> print(uniform_plan(5, 2))
        Plan for layers 0-4
          recompute 0-1
            keep 0-1
          keep 2-4
    """

    items: tuple[Item, ...]
    predicted_peak_bytes: int | None = field(default=None, compare=False)
    predicted_time: float | None = field(default=None, compare=False)

    @property
    def start(self) -> int:
        return self.items[0].start

    @property
    def stop(self) -> int:
        return self.items[-1].stop

    def check(self, n: int) -> None:
        """Raise :class:`PlanError` unless the plan covers layers 0..n-1 exactly."""
        if self.start != 0 or self.stop != n:
            raise PlanError(
                f"seqckpt: segments plan covers layers {self.start}-{self.stop - 1}, "
                f"but the chain has {n} modules (0-{n - 1}); make the plan for this "
                "chain."
            )
        self._check_contiguous()

    def _check_contiguous(self) -> None:
        if not self.items:
            raise PlanError("seqckpt: segments plan has no items.")
        at = self.items[0].start
        for item in self.items:
            if item.start != at or item.stop <= item.start:
                raise PlanError(
                    f"seqckpt: segments plan item {item.start}-{item.stop - 1} does "
                    f"not continue at layer {at}; items must be contiguous and "
                    "non-empty."
                )
            if isinstance(item, Recompute):
                if (item.inner.start, item.inner.stop) != (item.start, item.stop):
                    raise PlanError(
                        f"seqckpt: segments plan: the inner plan of recompute "
                        f"{item.start}-{item.stop - 1} covers "
                        f"{item.inner.start}-{item.inner.stop - 1}."
                    )
                item.inner._check_contiguous()
            at = item.stop

    # ------------------------------------------------------------- display

    def __str__(self) -> str:
        head = f"Plan for layers {self.start}-{self.stop - 1}"
        notes = []
        if self.predicted_peak_bytes is not None:
            notes.append(f"predicted peak {self.predicted_peak_bytes / 2**20:.2f} MiB")
        if self.predicted_time is not None:
            notes.append(f"predicted step {self.predicted_time * 1e3:.3f} ms")
        if notes:
            head += " (" + ", ".join(notes) + ")"
        return "\n".join([head, *self._lines(1)])

    def _lines(self, depth: int) -> list[str]:
        pad = "  " * depth
        lines = []
        for item in self.items:
            span = f"{item.start}-{item.stop - 1}"
            if isinstance(item, Run):
                lines.append(f"{pad}keep {span}")
            else:
                policy = "" if item.policy is None else f" keeping {item.policy}"
                lines.append(f"{pad}recompute {span}{policy}")
                lines.extend(item.inner._lines(depth + 1))
        return lines

    def checkpoints(self) -> int:
        """How many checkpointed regions the plan runs, nested ones included."""
        return sum(
            1 + i.inner.checkpoints() for i in self.items if isinstance(i, Recompute)
        )

    # ---------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "seqckpt.plan/1",
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time": self.predicted_time,
            "items": _items_to_json(self.items),
        }

    def to_json(self) -> str:
        """The plan as JSON text; :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Read a plan written by :meth:`to_json`; malformed text raises PlanError."""
        return load_json(text, "plan", Plan.from_dict)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Plan:
        """Read what :meth:`to_dict` wrote (see :meth:`from_json`)."""
        check_format(data, "seqckpt.plan/1", "plan")
        plan = Plan(
            _items_from_json(data["items"]),
            _opt(data.get("predicted_peak_bytes"), int),
            _opt(data.get("predicted_time"), float),
        )
        plan._check_contiguous()
        return plan


T = TypeVar("T")


def check_format(data: Any, expected: str, kind: str) -> None:
    """Raise PlanError unless ``data`` is a JSON object of format ``expected``."""
    if data.get("format") != expected:
        raise PlanError(
            f"seqckpt: {kind} JSON has format {data.get('format')!r}, "
            f"expected {expected!r}."
        )


def load_json(text: str, kind: str, build: Callable[[Any], T]) -> T:
    """``build`` applied to the JSON in ``text``; what is malformed (not JSON,
    a key missing, a value of the wrong type) raises PlanError naming ``kind``."""
    try:
        return build(json.loads(text))
    except PlanError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise PlanError(f"seqckpt: malformed {kind} JSON: {error}") from error


def _opt(value: Any, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"seqckpt: plan JSON has a non-number prediction {value!r}.")
    return kind(value)


def _items_to_json(items: tuple[Item, ...]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if isinstance(item, Run):
            out.append({"keep": [item.start, item.stop]})
        else:
            entry: dict[str, Any] = {
                "recompute": [item.start, item.stop],
                "inner": _items_to_json(item.inner.items),
            }
            if item.policy is not None:
                entry["policy"] = item.policy.to_json()
            out.append(entry)
    return out


def _span(value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise PlanError(f"seqckpt: plan JSON has a bad layer span {value!r}.")
    return value[0], value[1]


def _items_from_json(data: Any) -> tuple[Item, ...]:
    if not isinstance(data, list) or not data:
        raise PlanError(f"seqckpt: plan JSON items must be a non-empty list: {data!r}")
    items: list[Item] = []
    for entry in data:
        if not isinstance(entry, dict):
            raise PlanError(f"seqckpt: plan JSON item is not an object: {entry!r}")
        if "keep" in entry:
            items.append(Run(*_span(entry["keep"])))
        elif "recompute" in entry:
            start, stop = _span(entry["recompute"])
            policy = entry.get("policy")
            items.append(
                Recompute(
                    start,
                    stop,
                    Plan(_items_from_json(entry["inner"])),
                    None if policy is None else Policy.from_json(policy),
                )
            )
        else:
            raise PlanError(f"seqckpt: plan JSON item has no keep/recompute: {entry!r}")
    return tuple(items)


# ------------------------------------------------------------------ builders


def plan_from_sizes(
    sizes: list[int] | tuple[int, ...], policy: Policy | None = None
) -> Plan:
    """All segments but the last checkpointed, of the given sizes, each keeping
    what ``policy`` selects.

    Example:
        >>> print(plan_from_sizes([2, 1]))
        Plan for layers 0-2
          recompute 0-1
            keep 0-1
          keep 2-2
    """
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return _plan_from_starts(starts, sum(sizes), policy)


def _plan_from_starts(
    starts: list[int], n: int, policy: Policy | None, last_plain: bool = True
) -> Plan:
    """Segments beginning at ``starts`` (increasing), all but the last
    checkpointed (``last_plain=False``: all); layers before the first start
    run plainly."""
    items: list[Item] = [Run(0, starts[0])] if starts[0] > 0 else []
    for start, stop in zip(starts, [*starts[1:], n], strict=True):
        if stop == n and last_plain:
            items.append(Run(start, stop))
        else:
            items.append(Recompute(start, stop, Plan((Run(start, stop),)), policy))
    if len(items) > 1 and isinstance(items[0], Run) and isinstance(items[1], Run):
        items[:2] = [Run(0, items[1].stop)]  # one segment, shifted: all plain
    return Plan(tuple(items))


def balanced_sizes(n: int, k: int) -> list[int]:
    """``k`` contiguous sizes summing to ``n`` that differ by at most one.

    The smaller ones come first: the first segments are those torch makes, and
    the remainder is spread over the last ones instead of piling up in the plain
    tail. Early layers of CNNs have the largest activations, so short early
    segments keep the biggest recompute small, and the plain tail (never
    recomputed) is as long as balance allows.

    Example:
        >>> balanced_sizes(30, 8)
        [3, 3, 4, 4, 4, 4, 4, 4]
    """
    base, extra = divmod(n, k)
    return [base] * (k - extra) + [base + 1] * extra


def uniform_plan(
    n: int,
    k: int,
    blocked: Callable[[int], bool] | None = None,
    policy: Policy | None = None,
    last_plain: bool = True,
) -> Plan:
    """``n`` layers in ``k`` balanced segments, all but the last checkpointed
    (``last_plain=False``: all, as timm's ``checkpoint_seq`` and HF's
    per-layer checkpointing do), each keeping what ``policy`` selects.

    ``blocked(i)`` true means no checkpointed segment may start at layer ``i``
    (it writes into its input): such a start moves to the next layer, which
    makes the segment before it one longer (two starts that meet become one).

    Example:
        >>> print(uniform_plan(4, 2, blocked=lambda i: i == 2))
        Plan for layers 0-3
          recompute 0-2
            keep 0-2
          keep 3-3
    """
    sizes = balanced_sizes(n, k)
    starts = [sum(sizes[:i]) for i in range(k)]
    if blocked is not None:
        moved: list[int] = []
        for start in starts:
            while start < n and blocked(start):
                start += 1
            if start < n and (not moved or start > moved[-1]):
                moved.append(start)
        if not moved:  # every layer writes into its input: all plain
            return Plan((Run(0, n),))
        starts = moved
    return _plan_from_starts(starts, n, policy, last_plain)


def default_segments(n: int) -> int:
    """The default without a profile: about sqrt(n) segments, and at least two
    when there are two or more layers, so that something is checkpointed.

    Example:
        >>> [default_segments(n) for n in (1, 2, 3, 9, 30)]
        [1, 2, 2, 3, 5]
    """
    return min(n, max(2, round(math.sqrt(n))))
