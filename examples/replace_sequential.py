"""Checkpoint the stacks of blocks of an existing model, in place.

A ResNet-style model keeps its stages in nn.Sequential attributes; a transformer
keeps its blocks in one, or (nanoGPT) in an nn.ModuleList its forward loops
over. seqckpt.checkpoint_blocks swaps the former for CheckpointedSequential and
gives each block of the latter a checkpointed forward; either way every
parameter object and every state_dict key stays, so optimisers and saved
checkpoints carry over unchanged.
"""

import copy

import torch
from torch import nn

import seqckpt
from seqckpt import CheckpointedSequential


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.stage1 = nn.Sequential(*[Block(16) for _ in range(4)])
        self.stage2 = nn.Sequential(*[Block(16) for _ in range(4)])
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.stage1(self.stem(x)))
        return self.head(x.mean((2, 3)))


torch.manual_seed(0)
model = TinyResNet()
reference = copy.deepcopy(model)
seqckpt.checkpoint_blocks(model, segments=2)  # both stages swapped, in place
assert isinstance(model.stage1, CheckpointedSequential)
assert list(model.state_dict()) == list(reference.state_dict())

# A stack of transformer blocks, as many models hold them:
encoder = CheckpointedSequential(
    *[
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        for _ in range(4)
    ],
    segments=2,
)
encoder(torch.randn(2, 5, 32)).sum().backward()


class TinyGPT(nn.Module):
    """nanoGPT's shape: the forward loops over an nn.ModuleList of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.h = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 128, dropout=0.1, batch_first=True)
            for _ in range(4)
        )
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.h:
            x = block(x)
        return self.head(x)


gpt = TinyGPT()
gpt_reference = copy.deepcopy(gpt)
seqckpt.checkpoint_blocks(gpt)  # each block of gpt.h becomes a region
tokens = torch.randint(0, 64, (8, 48))


def step(net: nn.Module, inputs: torch.Tensor) -> int:
    """One training step from a fixed seed; the peak bytes it allocated."""
    torch.manual_seed(1)  # the same dropout masks in both runs
    with seqckpt.track_memory("cpu") as mem:
        net(inputs).float().sum().backward()
    return mem.peak_bytes


x = torch.randn(4, 3, 16, 16)
step(model, x)
step(reference, x)
gpt_peak, plain_peak = step(gpt, tokens), step(gpt_reference, tokens)
same = all(
    torch.equal(a.grad, b.grad)
    for a, b in zip(
        [*model.parameters(), *gpt.parameters()],
        [*reference.parameters(), *gpt_reference.parameters()],
        strict=True,
    )
) and all(
    torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers(), strict=True)
)
print(f"gradients and BatchNorm statistics bitwise equal: {same}")
print(
    f"TinyGPT peak: {plain_peak / 2**20:.2f} MiB plain, {gpt_peak / 2**20:.2f} MiB checkpointed"
)
