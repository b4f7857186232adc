"""Replace the nn.Sequential parts of an existing model with CheckpointedSequential.

A ResNet-style model keeps its stages in nn.Sequential attributes; a transformer
keeps its blocks in one. Swapping them for CheckpointedSequential keeps every
parameter object and every state_dict key, so optimisers and saved checkpoints
carry over unchanged.
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

x = torch.randn(4, 3, 16, 16)
model(x).sum().backward()
reference(x).sum().backward()
same = all(
    torch.equal(a.grad, b.grad)
    for a, b in zip(model.parameters(), reference.parameters(), strict=False)
) and all(
    torch.equal(a, b)
    for a, b in zip(model.buffers(), reference.buffers(), strict=False)
)
print(f"gradients and BatchNorm statistics bitwise equal: {same}")
