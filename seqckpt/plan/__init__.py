"""Plans: the tree of kept and recomputed layers, and the builders of plans."""

from seqckpt.plan.tree import (
    Plan,
    PlanError,
    Recompute,
    Run,
    balanced_sizes,
    plan_from_sizes,
    uniform_plan,
)

__all__ = [
    "Plan",
    "PlanError",
    "Recompute",
    "Run",
    "balanced_sizes",
    "plan_from_sizes",
    "uniform_plan",
]
