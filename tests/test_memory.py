"""seqckpt.track_memory: the measurement itself."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import seqckpt
from seqckpt import track_memory


def test_known_allocations() -> None:
    with track_memory("cpu") as mem:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        del a
        c = torch.empty(250, dtype=torch.int32)  # 1000 bytes
    assert mem.peak_bytes == 8000
    assert mem.end_bytes == 5000
    assert mem.baseline_bytes == 0
    del b, c


def test_views_share_storage_and_preexisting_tensors_do_not_count() -> None:
    outside = torch.ones(1000)
    with track_memory() as mem:
        v = outside[:10]
        w = outside.view(10, 100)
        x = torch.zeros(100)
        y = x.view(10, 10)
    assert mem.peak_bytes == 400
    del v, w, x, y


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(12)]
    )


def peak(fn, model: nn.Module, x: torch.Tensor) -> int:  # type: ignore[no-untyped-def]
    """Peak of one step, with no .grad alive before it (else the first run
    allocates gradients that later runs accumulate into)."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    with track_memory() as mem:
        fn().sum().backward()
    return mem.peak_bytes


def test_checkpointed_chain_reports_less() -> None:
    model = chain()
    x = torch.randn(512, 32, requires_grad=True)
    plain = peak(lambda: model(x), model, x)
    ckpt = peak(lambda: seqckpt.checkpoint_sequential(model, 4, x), model, x)
    assert ckpt < 0.6 * plain


BLOCKS = {
    "linear_gelu": lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU()),  # saves input
    "linear_relu": lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU()),  # saves output
    "linear": lambda: nn.Linear(8, 8),
}


@pytest.mark.parametrize("block", list(BLOCKS))
def test_balanced_segments_never_above_torch_on_uniform_chains(block: str) -> None:
    """Every segment count of every chain of 1..20 equal layers: the peak of one
    step is at most torch's, and lower wherever torch puts a remainder of two or
    more layers into its plain tail.

    With n = q*k + r and one activation a per layer, torch peaks at about
    (k - 1 + q + r) * a (its stored segment inputs plus its plain tail), balanced
    segments at (k + q) * a when r > 0: never more, and about r - 1 activations
    less (a little under that, from transient buffers of the backward).
    """
    for layers in range(1, 21):
        torch.manual_seed(0)
        model = nn.Sequential(*[BLOCKS[block]() for _ in range(layers)])
        x = torch.randn(256, 8, requires_grad=True)
        for k in range(1, layers + 1):
            ours = peak(lambda: seqckpt.checkpoint_sequential(model, k, x), model, x)
            theirs = peak(
                lambda: tc.checkpoint_sequential(model, k, x, use_reentrant=False),
                model,
                x,
            )
            assert ours <= theirs, (layers, k, ours, theirs)
            if layers % k >= 2:
                assert ours < theirs, (layers, k, ours, theirs)


def test_oversized_tail_30_layers_8_segments() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(30)]
    )
    x = torch.randn(1024, 16, requires_grad=True)
    ours = peak(lambda: seqckpt.checkpoint_sequential(model, 8, x), model, x)
    theirs = peak(
        lambda: tc.checkpoint_sequential(model, 8, x, use_reentrant=False), model, x
    )
    assert ours < 0.8 * theirs


def test_unknown_device_is_an_error() -> None:
    with pytest.raises(ValueError, match="^seqckpt: .*'mps'"), track_memory("mps"):
        pass


@pytest.mark.cuda
def test_cuda_and_cpu_figures_agree() -> None:
    model = chain()
    x = torch.randn(4096, 32, requires_grad=True)
    cpu = peak(lambda: seqckpt.checkpoint_sequential(model, 4, x), model, x)
    model.cuda()
    xc = x.detach().cuda().requires_grad_()
    seqckpt.checkpoint_sequential(model, 4, xc).sum().backward()  # warm up
    model.zero_grad(set_to_none=True)
    xc.grad = None
    with track_memory("cuda") as mem:
        seqckpt.checkpoint_sequential(model, 4, xc).sum().backward()
    assert abs(mem.peak_bytes - cpu) <= 0.05 * cpu
