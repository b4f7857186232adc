"""Checkpoint a small chain and check that its gradients equal the plain run's."""

import copy

import torch

import seqckpt

torch.manual_seed(0)
model = torch.nn.Sequential(
    *[
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
        for _ in range(16)
    ]
)
twin = copy.deepcopy(model)
x = torch.randn(64, 256, requires_grad=True)

model(x).sum().backward()
seqckpt.checkpoint_sequential(twin, 4, x.detach().requires_grad_()).sum().backward()

same = all(
    torch.equal(a.grad, b.grad)
    for a, b in zip(model.parameters(), twin.parameters(), strict=False)
)
print(f"gradients bitwise equal: {same}")

# The same check done by seqckpt, on copies of the chain, with peak memory (at
# a batch where activations, not the parameters' gradients, make the peak):
(row,) = seqckpt.validate(model, sample=torch.randn(1024, 256), segments=4)
print(
    f"validate: bitwise equal {row['bitwise_equal']}, peak "
    f"{row['peak_mib_plain']:.2f} -> {row['peak_mib_checkpointed']:.2f} MiB"
)
