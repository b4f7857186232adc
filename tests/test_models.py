"""The embedded models: chains that build deterministically and train."""

from __future__ import annotations

import pytest
import torch

from seqckpt import checkpoint_sequential
from seqckpt.models import MODELS
from tests.oracle import assert_matches_plain


@pytest.mark.parametrize("name", list(MODELS))
def test_builds_deterministically_and_checkpoints_bitwise(name: str) -> None:
    spec = MODELS[name]
    a, b = spec.build(), spec.build()
    assert all(
        torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=False)
    )
    x = spec.sample("cpu", batch=2)
    assert x.shape == (2, *spec.input_shape)
    assert torch.equal(x, spec.sample("cpu", batch=2))
    assert_matches_plain(
        lambda: spec.build(), x, lambda m, x: checkpoint_sequential(m, spec.segments, x)
    )


def test_resnet_activations_shrink_with_depth() -> None:
    spec = MODELS["resnet"]
    model = spec.build()
    sizes = []
    h = spec.sample("cpu", batch=1)
    for layer in model:
        h = layer(h)
        sizes.append(h.numel())
    assert sizes[0] > sizes[len(sizes) // 2] > sizes[-2]
