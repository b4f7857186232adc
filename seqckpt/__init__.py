"""seqckpt: activation checkpointing for sequential PyTorch models.

Example:
    >>> import torch, seqckpt
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    >>> x = torch.randn(4, 16, requires_grad=True)
    >>> y = seqckpt.checkpoint_sequential(model, 2, x)
    >>> y.sum().backward()
"""

import warnings

with warnings.catch_warnings():
    # torch's CPU wheels run without NumPy but warn "Failed to initialize NumPy"
    # when it is missing. seqckpt never uses NumPy, so its own import of torch
    # silences that one message (only when seqckpt is what imports torch first).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from seqckpt import policies
from seqckpt._state import is_checkpointing, is_recomputing
from seqckpt.blocks import CheckpointedForward, checkpoint_blocks
from seqckpt.checkpoint import CheckpointedFunction, CheckpointError, checkpoint
from seqckpt.keep import KeptForward, keep, keep_modules
from seqckpt.kept_report import KeptReport, what_is_kept
from seqckpt.memory import MemoryStats, track_memory
from seqckpt.planner import Plan, PlanError, plan, profile
from seqckpt.policies import name
from seqckpt.sequential import CheckpointedSequential, checkpoint_sequential
from seqckpt.torch_drop_in import replace_torch_checkpoint
from seqckpt.validation import validate

__all__ = [
    "CheckpointError",
    "CheckpointedForward",
    "CheckpointedFunction",
    "CheckpointedSequential",
    "KeptForward",
    "KeptReport",
    "MemoryStats",
    "Plan",
    "PlanError",
    "checkpoint",
    "checkpoint_blocks",
    "checkpoint_sequential",
    "is_checkpointing",
    "is_recomputing",
    "keep",
    "keep_modules",
    "name",
    "plan",
    "policies",
    "profile",
    "replace_torch_checkpoint",
    "track_memory",
    "validate",
    "what_is_kept",
]
__version__ = "0.1.0"
