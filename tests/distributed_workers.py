"""Workers for tests/test_distributed.py, run in 2 processes on the gloo backend.

Each rank trains on its half of a batch; after one step its gradients must equal
a single-process step of the plain model on the whole batch (the loss is a mean,
so the average DDP/FSDP take over ranks is the whole-batch gradient).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import seqckpt
from seqckpt.planner import Plan, Recompute, Run
from tests.test_blocks import Loop

BATCH, WIDTH, LAYERS = 8, 16, 6


def _model() -> nn.Sequential:
    # Deterministic layers only: dropout draws per rank and BatchNorm's batch
    # statistics per half batch would legitimately differ from one process.
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh())
            for _ in range(LAYERS)
        ]
    )


NESTED_PLAN = Plan(
    (
        Recompute(0, 3, Plan((Run(0, 1), Recompute(1, 3, Plan((Run(1, 3),)))))),
        Recompute(3, 5, Plan((Run(3, 5),))),
        Run(5, 6),
    )
)


class _FunctionalChain(nn.Module):
    """A model whose forward calls seqckpt.checkpoint_sequential on its stack."""

    def __init__(self, stack: nn.Sequential, segments: Any) -> None:
        super().__init__()
        self.stack = stack
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = seqckpt.checkpoint_sequential(self.stack, self.segments, x)
        return out


def _wrap(kind: str, model: nn.Sequential) -> nn.Module:
    if kind == "module":
        return seqckpt.CheckpointedSequential.from_sequential(model, segments=3)
    if kind == "function":
        return _FunctionalChain(model, 2)
    if kind == "plan":
        return seqckpt.CheckpointedSequential.from_sequential(
            model, segments=NESTED_PLAN
        )
    if kind == "blocks":
        return seqckpt.checkpoint_blocks(Loop(model))
    raise ValueError(kind)


def _batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(BATCH, WIDTH)


def _reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The whole batch and a single-process step's gradients on it."""
    model = _model()
    x = _batch()
    model(x).pow(2).mean().backward()
    return x, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _init(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _exit_cleanly() -> None:
    """Leave a worker whose checks all passed without the interpreter's shutdown:
    gloo's threads sometimes abort it there ("terminate called without an active
    exception", SIGABRT) after a run that succeeded. Failures never get here;
    they raise and the spawner reports them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ddp_worker(rank: int, port: int, kind: str, options: dict[str, Any]) -> None:
    _init(rank, port)
    try:
        x, expected = _reference()
        model = _wrap(kind, _model())
        ddp = nn.parallel.DistributedDataParallel(model, **options)
        half = x.chunk(2)[rank].clone().requires_grad_()
        for _ in range(2 if options.get("static_graph") else 1):
            ddp.zero_grad(set_to_none=True)
            ddp(half).pow(2).mean().backward()
        got = [p.grad for p in ddp.parameters()]
        assert all(g is not None for g in got), "a parameter got no gradient"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert torch.allclose(g, e, rtol=1e-5, atol=1e-6), (  # type: ignore[arg-type]
                f"rank {rank} {kind} {options}: grad {i} differs by "
                f"{(g - e).abs().max().item()}"  # type: ignore[operator]
            )
        dist.barrier()  # both ranks done before the group is torn down
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def fsdp_worker(rank: int, port: int, kind: str, options: dict[str, Any]) -> None:
    """The checkpointed model under FSDP2 against the plain one under FSDP2 on
    the same ranks: bitwise equal gradients. (Not against a single process:
    torch 2.8's FSDP2 over gloo already differs from one there.)"""
    from torch.distributed.fsdp import fully_shard

    _init(rank, port)
    try:
        half = _batch().chunk(2)[rank].clone().requires_grad_()
        grads = []
        for model in (_model(), _wrap(kind, _model())):
            blocks = model if isinstance(model, nn.Sequential) else model.stack  # type: ignore[union-attr]
            for block in blocks:
                fully_shard(block)
            fully_shard(model)
            model(half).pow(2).mean().backward()
            grads.append([p.grad.full_tensor() for p in model.parameters()])  # type: ignore[union-attr]
        for i, (got, plain) in enumerate(zip(grads[1], grads[0], strict=True)):
            assert torch.equal(got, plain), (
                f"rank {rank} fsdp {kind}: grad {i} differs from plain FSDP2 by "
                f"{(got - plain).abs().max().item()}"
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def auto_worker(rank: int, port: int, kind: str, options: dict[str, Any]) -> None:
    """segments='auto' under DDP with a different budget on each rank: every
    rank plans with the smallest and uses rank 0's plan."""
    from seqckpt.planner.planning import _AUTO_CACHE

    _init(rank, port)
    try:
        x, expected = _reference()
        budget = options["budgets"][rank]
        model = seqckpt.CheckpointedSequential.from_sequential(
            _model(), segments="auto", memory_budget=budget
        )
        ddp = nn.parallel.DistributedDataParallel(model)
        half = x.chunk(2)[rank].clone().requires_grad_()
        ddp(half).pow(2).mean().backward()
        for i, (g, e) in enumerate(zip(ddp.parameters(), expected, strict=True)):
            assert torch.allclose(g.grad, e, rtol=1e-5, atol=1e-6), f"grad {i}"  # type: ignore[arg-type]
        from seqckpt.planner.planning import broadcast_text

        ((_, plan),) = _AUTO_CACHE.values()
        assert broadcast_text(plan.to_json(), torch.device("cpu")) == plan.to_json(), (
            f"rank {rank} runs another plan than rank 0"
        )
        assert plan.predicted_peak_bytes <= min(options["budgets"])  # type: ignore[operator]
        assert plan.checkpoints() > 0
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


class _ParallelMLP(nn.Module):
    """A Megatron-style MLP for tensor parallelism: a column-parallel linear,
    GELU and an in-place op on its output (written over what a policy may
    keep), a row-parallel linear, dropout and a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(x)).mul_(2.0)
        return x + self.drop(self.down(h))


TP_POLICIES: dict[str, dict[str, Any]] = {
    "none": {},
    "compute_heavy": {"policy": "compute_heavy"},
    "everything_values": {
        "policy": lambda op, *args, **kwargs: True,
        "determinism_check": "values",
    },
}


def tp_worker(rank: int, port: int, kind: str, options: dict[str, Any]) -> None:
    """Tensor parallelism (the linears' weights and inputs are DTensors sharded
    over the two ranks) with each block checkpointed under a policy: bitwise
    the plain tensor-parallel step on the same ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _init(rank, port)
    try:
        mesh = init_device_mesh("cpu", (2,))
        # The hidden activations stay DTensors (sharded) between the linears.
        plan = {
            "up": ColwiseParallel(use_local_output=False),
            "down": RowwiseParallel(),
        }
        results = []
        for checkpointed in (False, True):
            torch.manual_seed(0)
            blocks = nn.ModuleList(_ParallelMLP() for _ in range(3))
            for block in blocks:
                parallelize_module(block, mesh, plan)
            x = _batch().requires_grad_()
            torch.manual_seed(2)
            y = x
            for block in blocks:
                y = (
                    seqckpt.checkpoint(block, y, **TP_POLICIES[kind])
                    if checkpointed
                    else block(y)
                )
            y.pow(2).mean().backward()
            grads = [p.grad.full_tensor() for p in blocks.parameters()]  # type: ignore[union-attr]
            results.append((y.detach(), x.grad, grads))
        (y0, gx0, g0), (y1, gx1, g1) = results
        assert torch.equal(y0, y1), f"rank {rank} tp {kind}: outputs differ"
        assert torch.equal(gx0, gx1), f"rank {rank} tp {kind}: input grads differ"  # type: ignore[arg-type]
        for i, (a, b) in enumerate(zip(g0, g1, strict=True)):
            assert torch.equal(a, b), f"rank {rank} tp {kind}: grad {i} differs"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


class Residual(nn.Module):
    """A residual block (the unit FSDP1 wraps here; also the block of the
    nesting tests in test_torch_parity); ``checkpoint``: how its forward
    calls its body (None: plainly)."""

    def __init__(self, body: nn.Module, checkpoint: Any = None) -> None:
        super().__init__()
        self.body = body
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.body
        return x + (self.checkpoint(body, x) if self.checkpoint else body(x))


def fsdp1_worker(rank: int, port: int, kind: str, options: dict[str, Any]) -> None:
    """FSDP1 (``FullyShardedDataParallel``, as accelerate and Lightning wrap),
    one unit per block, two steps: seqckpt inside each block's forward,
    through torch's ``checkpoint_wrapper`` applied after wrapping, or a
    ``CheckpointedSequential`` around the units; gradients bitwise those of
    plain FSDP1 on the same ranks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def blocks(checkpoint: Any = None) -> nn.Sequential:
        return nn.Sequential(*(Residual(block, checkpoint) for block in _model()[:4]))

    def sharded(model: nn.Module) -> nn.Module:
        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Residual}),
            device_id=torch.device("cpu"),  # (FSDP1 wants an accelerator else)
            **options,
        )

    _init(rank, port)
    try:
        half = _batch().chunk(2)[rank].clone()
        if kind == "inside":
            model = sharded(blocks(seqckpt.checkpoint))
        elif kind == "wrapper":
            model = sharded(blocks())
            apply_activation_checkpointing(
                model,
                checkpoint_wrapper_fn=partial(
                    checkpoint_wrapper, checkpoint_fn=seqckpt.checkpoint
                ),
                check_fn=lambda m: isinstance(m, Residual),
            )
        else:
            stack = seqckpt.CheckpointedSequential.from_sequential(blocks(), segments=2)
            model = sharded(stack)
        grads = []
        for m in (sharded(blocks()), model):
            for _ in range(2):
                m.zero_grad(set_to_none=True)
                m(half.clone().requires_grad_()).pow(2).mean().backward()
            # this rank's shards (None where a parameter has none here)
            grads.append([p.grad for p in m.parameters()])
        assert any(g is not None for g in grads[0])
        for i, (got, plain) in enumerate(zip(grads[1], grads[0], strict=True)):
            if plain is None:
                assert got is None, f"rank {rank} fsdp1 {kind}: grad {i} not None"
                continue
            assert got is not None and torch.equal(got, plain), (
                f"rank {rank} fsdp1 {kind} {options}: grad {i} differs from plain "
                f"FSDP1 by {(got - plain).abs().max().item() if got is not None else got}"
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


WORKERS: dict[str, Callable[..., None]] = {
    "ddp": ddp_worker,
    "fsdp": fsdp_worker,
    "fsdp1": fsdp1_worker,
    "auto": auto_worker,
    "tp": tp_worker,
}
