"""seqckpt.track_memory: the measurement itself."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import seqckpt
from seqckpt import checkpoint_sequential, track_memory
from seqckpt.models import MODELS
from seqckpt.planner.frontier import measure_peak


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


def test_a_wrapper_subclass_counts_the_memory_of_its_inner_tensors() -> None:
    # A wrapper subclass (DTensor, here torch's two-tensor test subclass) has a
    # storage of its own shape that holds nothing: DTensor's reads the global
    # size where a rank holds its shard. What counts is the inner tensors.
    from torch.testing._internal.two_tensor import TwoTensor

    outside = TwoTensor(torch.ones(1000), torch.ones(1000))
    with track_memory() as mem:
        doubled = outside * 2  # two new inner tensors of 4000 bytes
        view = doubled.view(10, 100)  # views of them: nothing new
        outside.mul_(3)  # in place: nothing new
        del doubled, view  # frees both inner tensors
    assert mem.peak_bytes == 8000
    assert mem.end_bytes == 0


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


@pytest.mark.parametrize("name", ["mlp", "resnet", "transformer", "gpt"])
def test_values_check_costs_at_most_ten_percent_more_memory(name: str) -> None:
    # Fingerprints are reductions accumulated in float64 without a float64 copy
    # of the saved tensor; "values" runs each recompute to its end (one more
    # activation at most) and keeps the first-run values of floating buffers.
    spec = MODELS[name]
    model, x = spec.build(), spec.sample("cpu", None)
    peaks = {}
    for check in ("default", "values"):
        peaks[check] = measure_peak(
            copy.deepcopy(model),
            x,
            lambda m, t: checkpoint_sequential(
                m, spec.segments, t, determinism_check=check
            ),
            "cpu",
        )
    assert peaks["values"] <= 1.10 * peaks["default"], peaks


class FakeCudaAllocator:
    """The caching allocator's counters, for testing the CUDA meter's logic on
    a machine without a GPU."""

    def __init__(self) -> None:
        self.allocated = self.peak = self.reserved = self.peak_reserved = 0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)  # cached blocks stay
        self.peak = max(self.peak, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def reset_peak(self) -> None:
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, value in {
            "synchronize": lambda device=None: None,
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak,
            "memory_reserved": lambda device=None: self.reserved,
            "max_memory_reserved": lambda device=None: self.peak_reserved,
            "reset_peak_memory_stats": lambda device=None: self.reset_peak(),
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_cuda_meter_nested_blocks_and_reserved_peaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCudaAllocator()
    fake.install(monkeypatch)
    fake.alloc(1000)  # already allocated before: the baseline
    with track_memory("cuda") as outer:
        fake.alloc(400)
        fake.free(400)  # the outer block's peak, before the inner one resets
        with track_memory("cuda") as inner:
            fake.alloc(100)
            fake.free(100)
        fake.alloc(50)
    assert (inner.baseline_bytes, inner.peak_bytes) == (1000, 100)
    assert (outer.baseline_bytes, outer.peak_bytes, outer.end_bytes) == (1000, 400, 50)
    assert outer.peak_reserved_bytes == 400  # the allocator kept the 400 cached
    assert inner.peak_reserved_bytes == 0  # served from what was cached
    with track_memory("cuda") as again:  # no meter left open
        fake.alloc(10)
    assert again.peak_bytes == 10


def test_cpu_peak_reserved_equals_peak() -> None:
    with track_memory("cpu") as mem:
        torch.empty(256)
    assert mem.peak_reserved_bytes == mem.peak_bytes == 1024


def test_stopwatch_times_each_call_on_the_cpu() -> None:
    from seqckpt.memory import Stopwatch

    watch = Stopwatch(torch.device("cpu"))
    assert watch.run(lambda: 7) == 7
    watch.run(lambda: torch.randn(256, 256) @ torch.randn(256, 256))
    first, second = watch.seconds()
    assert 0 <= first < second


@pytest.mark.cuda
def test_stopwatch_on_cuda_uses_events_and_one_synchronisation() -> None:
    from seqckpt.memory import Stopwatch

    watch = Stopwatch(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        watch.run(lambda: a @ a)
    small = Stopwatch(torch.device("cuda"))
    small.run(lambda: a[:1, :1] + 1)
    big, (tiny,) = watch.seconds(), small.seconds()
    assert len(big) == 3 and all(t > 0 for t in big)
    assert tiny < min(big)  # no launch latency or sync charged to the small one
