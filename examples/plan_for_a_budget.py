"""Plan once for a memory budget, save the plan, and train with it.

Run: python examples/plan_for_a_budget.py

The ResNet-style model from seqckpt.models is profiled on a sample batch, the
fastest plan under half of the plain step's activation memory is found, saved as
JSON, loaded back (as a later training run would), and used by a
CheckpointedSequential. The script checks that the trained weights equal those of
plain training, and that the measured peak fits the budget.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

import seqckpt
from seqckpt.models import MODELS


def main() -> None:
    spec = MODELS["resnet"]
    model = spec.build()
    batch = spec.sample("cpu", batch=8)

    # Plan once: the fastest schedule whose peak fits half of "keep everything".
    fastest = seqckpt.plan(model, batch)
    budget = fastest.predicted_peak_bytes // 2  # type: ignore[operator]
    plan = seqckpt.plan(model, batch, budget)
    print(plan)

    path = Path(tempfile.mkdtemp()) / "resnet_plan.json"
    path.write_text(plan.to_json())
    loaded = seqckpt.Plan.from_json(path.read_text())
    assert loaded == plan

    plain = copy.deepcopy(model)
    ckpt = seqckpt.CheckpointedSequential.from_sequential(model, segments=loaded)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_ckpt = torch.optim.SGD(ckpt.parameters(), lr=0.1)
    for p in [*plain.parameters(), *ckpt.parameters()]:
        p.grad = torch.zeros_like(p)  # the budget excludes parameter gradients

    for step in range(3):
        x = spec.sample("cpu", batch=8, seed=step)
        for net, opt in ((plain, opt_plain), (ckpt, opt_ckpt)):
            opt.zero_grad(set_to_none=False)
            with seqckpt.track_memory("cpu") as mem:
                net(x).logsumexp(dim=1).mean().backward()
            opt.step()
        print(f"step {step}: checkpointed peak {mem.peak_mib:.2f} MiB")
        assert mem.peak_bytes <= 1.15 * budget

    for a, b in zip(
        plain.state_dict().values(), ckpt.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), "checkpointed training drifted from plain training"
    print(f"budget {budget / 2**20:.2f} MiB; weights and BatchNorm stats equal plain")


if __name__ == "__main__":
    main()
