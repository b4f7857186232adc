"""Plans and the planner: the tree of kept and recomputed layers, its builders,
the profiler, the cost model and the solver."""

from seqckpt.planner.adaptive import Frontier
from seqckpt.planner.budget import parse_budget
from seqckpt.planner.cost import plan_cost
from seqckpt.planner.planning import plan
from seqckpt.planner.profile import ChainProfile, LayerProfile, PolicyCost, profile
from seqckpt.planner.tree import (
    Plan,
    PlanError,
    Recompute,
    Run,
    balanced_sizes,
    plan_from_sizes,
    uniform_plan,
)

__all__ = [
    "ChainProfile",
    "Frontier",
    "LayerProfile",
    "Plan",
    "PlanError",
    "PolicyCost",
    "Recompute",
    "Run",
    "balanced_sizes",
    "parse_budget",
    "plan",
    "plan_cost",
    "plan_from_sizes",
    "profile",
    "uniform_plan",
]
