"""seqckpt: activation checkpointing for sequential PyTorch models.

Example:
    >>> import torch, seqckpt
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    >>> x = torch.randn(4, 16, requires_grad=True)
    >>> y = seqckpt.checkpoint_sequential(model, 2, x)
    >>> y.sum().backward()
"""

from seqckpt._state import is_checkpointing, is_recomputing
from seqckpt.checkpoint import CheckpointError, checkpoint

__all__ = [
    "CheckpointError",
    "checkpoint",
    "is_checkpointing",
    "is_recomputing",
]
__version__ = "0.1.0"
