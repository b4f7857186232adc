"""Small embedded models for the demo, validation and benchmarks (torch only, no
downloads). Each is a chain (``nn.Sequential``) with a sample-input factory sized
for the CPU and a larger one for a GPU.

Example:
    >>> from seqckpt.models import MODELS
    >>> spec = MODELS["mlp"]
    >>> model = spec.build()
    >>> x = spec.sample("cpu")
    >>> model(x).shape
    torch.Size([512, 10])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MODELS", "GPTBlock", "ModelSpec"]


@dataclass(frozen=True)
class ModelSpec:
    """A named chain and how to make inputs for it.

    Attributes:
        name: the name used on the command line.
        description: one line for listings.
        build: returns a fresh model, the same weights for the same seed.
        input_shape: shape of one sample (without the batch dimension).
        batch: default batch size on the CPU and on a GPU.
        segments: the default segment count for validation.
    """

    name: str
    description: str
    build_fn: Callable[[], nn.Sequential]
    input_shape: tuple[int, ...]
    batch: dict[str, int]
    segments: int

    def build(self, seed: int = 0) -> nn.Sequential:
        torch.manual_seed(seed)
        return self.build_fn()

    def sample(
        self, device: str | torch.device, batch: int | None = None, seed: int = 1
    ) -> torch.Tensor:
        """A batch of inputs on ``device``, CPU- or GPU-sized by default."""
        dev = torch.device(device)
        n = (
            batch
            if batch is not None
            else self.batch["cuda" if dev.type == "cuda" else "cpu"]
        )
        generator = torch.Generator().manual_seed(seed)
        return torch.randn((n, *self.input_shape), generator=generator).to(dev)


def _mlp() -> nn.Sequential:
    width = 256
    blocks: list[nn.Module] = [nn.Linear(128, width)]
    for _ in range(12):
        blocks.append(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1))
        )
    blocks.append(nn.Linear(width, 10))
    return nn.Sequential(*blocks)


class _Residual(nn.Module):
    """conv-bn-relu-conv-bn plus a (strided) shortcut, then relu."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut: nn.Module = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _resnet() -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
    ]
    channels = 16
    for stage, cout in enumerate((16, 32, 64, 128)):
        for block in range(3):
            stride = 2 if block == 0 and stage > 0 else 1
            layers.append(_Residual(channels, cout, stride))
            channels = cout
    layers.append(
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))
    )
    return nn.Sequential(*layers)


def _transformer() -> nn.Sequential:
    d_model = 128
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(
                d_model,
                nhead=4,
                dim_feedforward=4 * d_model,
                dropout=0.1,
                batch_first=True,
            )
            for _ in range(8)
        ]
    )


class GPTBlock(nn.Module):
    """A pre-norm GPT block: LayerNorm, QKV projection, causal scaled-dot-product
    attention, output projection, residual; LayerNorm, MLP with GELU,
    residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """The attention branch, without its residual."""
        batch, length, width = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(batch, length, 3, self.heads, width // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(
            attended.transpose(1, 2).reshape(batch, length, width)
        )
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        out: torch.Tensor = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return out


def _gpt() -> nn.Sequential:
    return nn.Sequential(*[GPTBlock(128, 4) for _ in range(8)])


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "mlp",
            "14 blocks of Linear(256) + GELU + Dropout",
            _mlp,
            (128,),
            {"cpu": 512, "cuda": 16384},
            4,
        ),
        ModelSpec(
            "resnet",
            "ResNet-style CNN with BatchNorm, 14 items, activations shrink with depth",
            _resnet,
            (3, 32, 32),
            {"cpu": 16, "cuda": 256},
            4,
        ),
        ModelSpec(
            "transformer",
            "8 transformer encoder blocks (d_model 128, 4 heads, dropout)",
            _transformer,
            (64, 128),
            {"cpu": 8, "cuda": 128},
            3,
        ),
        ModelSpec(
            "gpt",
            "8 pre-norm GPT blocks (width 128, 4 heads, causal attention, GELU MLP)",
            _gpt,
            (128, 128),
            {"cpu": 8, "cuda": 64},
            3,
        ),
    )
}
