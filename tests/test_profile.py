"""seqckpt.profile: what it measures, and that it leaves the model untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seqckpt
from tests.test_robustness import NoiseOfItsOwn


def bn_dropout_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.Dropout(0.5),
        nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
        nn.Linear(32, 4),
    )


def test_profile_is_sandboxed() -> None:
    model = bn_dropout_chain()
    model[3].eval()  # a mixed training flag must survive too
    x = torch.randn(8, 16)
    model(x).sum().backward()  # existing .grad values and updated BN stats
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads if g is not None]
    buffers = [b.clone() for b in model.buffers()]
    flags = [m.training for m in model.modules()]
    torch.manual_seed(123)
    rng = torch.get_rng_state()

    seqckpt.profile(model, x, repeats=2)

    assert torch.equal(torch.get_rng_state(), rng)
    assert all(
        torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True)
    )
    assert all(a is p.grad for a, p in zip(grads, model.parameters(), strict=True))
    now = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grad_values, now, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert [m.training for m in model.modules()] == flags


def test_profile_leaves_a_modules_own_generator_where_it_was() -> None:
    # Profiling runs each item several times; a generator a module holds would
    # otherwise be left further on than training alone leaves it.
    model = nn.Sequential(nn.Linear(16, 16), NoiseOfItsOwn(16), nn.Linear(16, 4))
    before = model[1].gen.get_state()
    seqckpt.profile(model, torch.randn(8, 16), repeats=2)
    assert torch.equal(model[1].gen.get_state(), before)
    model(torch.randn(8, 16))  # (the check can fail: a forward moves it)
    assert not torch.equal(model[1].gen.get_state(), before)


def test_profile_keeps_none_grads_none() -> None:
    model = bn_dropout_chain()
    seqckpt.profile(model, torch.randn(8, 16), repeats=1)
    assert all(p.grad is None for p in model.parameters())


def test_a_deep_copied_torchscript_block_is_profiled_quietly() -> None:
    # copy.deepcopy of a TorchScript module holds its parameters as clones with
    # a history (non-leaf): the sandbox read and wrote their .grad, and torch
    # warned about a non-leaf .grad on every profile.
    import copy
    import warnings

    block = copy.deepcopy(torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.GELU())))
    chain = nn.Sequential(block, nn.Linear(8, 8))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not a leaf Tensor")
        seqckpt.profile(chain, torch.randn(4, 8, requires_grad=True))
    assert all(p.grad is None for p in chain[1].parameters())


def test_sizes_follow_the_tensors() -> None:
    batch, width = 64, 32
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width))
    prof = seqckpt.profile(model, torch.randn(batch, 16), repeats=1)
    act = batch * width * 4
    assert [p.input_bytes for p in prof.layers] == [batch * 16 * 4, act, act]
    assert [p.output_bytes for p in prof.layers] == [act, act, act]
    # Linear saves its input (not new) and returns a new output; tanh saves its
    # output, which is also what it returns.
    assert [p.saved_bytes for p in prof.layers] == [act, act, act]
    # Each forward allocates only its output (the zero gradients the sandbox
    # gives parameters are made in the warm-up, not charged to the item).
    assert [p.nograd_peak_bytes for p in prof.layers] == [act, act, act]
    assert [p.forward_peak_bytes for p in prof.layers] == [act, act, act]
    for p in prof.layers:
        assert p.forward_peak_bytes >= p.saved_bytes
        assert p.nograd_peak_bytes >= p.output_bytes
        assert p.backward_peak_bytes >= p.output_bytes  # the output gradient
        assert p.forward_time > 0 and p.backward_time > 0


def test_tuple_passing_chain_and_plain_callables() -> None:
    lin = nn.Linear(8, 8)

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x

    def join(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lin(pair[0]) + pair[1]

    prof = seqckpt.profile([split, join], torch.randn(4, 8), repeats=1)
    assert prof.layers[0].name == "split"
    assert prof.layers[0].output_bytes == 2 * 4 * 8 * 4
    assert "split" in prof.table() and "join" in prof.table()


def test_shared_parameters_are_found_from_each_items_graph() -> None:
    # Two callables closing over one ModuleList: each uses only its own
    # layers (a walk of their modules would find all four in both); the one
    # called twice shares its layer with itself. The JSON round trip and the
    # table keep the figures.
    lins = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])

    def first(x: torch.Tensor) -> torch.Tensor:
        return lins[0](x).tanh()

    def middle(x: torch.Tensor) -> torch.Tensor:
        return lins[1](x).tanh()

    def last(x: torch.Tensor) -> torch.Tensor:
        return lins[2](x)

    x = torch.randn(4, 16, requires_grad=True)
    prof = seqckpt.profile([first, middle, middle, last], x, repeats=1)
    weight, bias = lins[1].weight.nbytes, lins[1].bias.nbytes
    assert [p.shared_grad_bytes for p in prof.layers] == [0, 2 * weight + bias, 0, 0]
    assert "shared by items" in prof.table()
    again = seqckpt.planner.ChainProfile.from_dict(prof.to_dict())
    assert again.layers[1].shared_grad_bytes == prof.layers[1].shared_grad_bytes
    plain = seqckpt.profile([first, middle, last], x, repeats=1)
    assert not any(p.shared_grad_bytes for p in plain.layers)
    assert "shared by items" not in plain.table()


def test_input_without_grad_has_no_input_gradient() -> None:
    model = nn.Sequential(nn.Linear(256, 256))
    x = torch.randn(512, 256)
    without = seqckpt.profile(model, x, repeats=1).layers[0]
    with_grad = seqckpt.profile(model, x.requires_grad_(), repeats=1).layers[0]
    assert with_grad.backward_peak_bytes >= without.backward_peak_bytes + x.nbytes


def test_modules_captured_by_plain_callables_are_sandboxed() -> None:
    lin = nn.Linear(8, 8)
    bn = nn.BatchNorm1d(8)

    def block(x: torch.Tensor) -> torch.Tensor:
        return bn(lin(x))

    stats = bn.running_mean.clone()
    seqckpt.profile([block, torch.tanh], torch.randn(4, 8), repeats=1)
    assert lin.weight.grad is None and lin.bias.grad is None
    assert torch.equal(bn.running_mean, stats)


class FirstCallCache(nn.Module):
    """Fills a cache (a table it reuses, such as rotary angles) on its first
    call; the cache is the module's state, not what a step allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.randn(4096)
        return torch.tanh(self.linear(x)) * self.table[0]


def test_first_calls_are_not_measured() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    warm = FirstCallCache()
    warm(x)
    cold = FirstCallCache()
    (measured_warm,) = seqckpt.profile(nn.Sequential(warm), x, repeats=1).layers
    # a plain callable meets the module inside the profile (its parameters'
    # zero gradients are made there) as well as filling the cache there
    (measured_cold,) = seqckpt.profile([lambda t: cold(t)], x, repeats=1).layers
    for field in ("nograd_peak_bytes", "forward_peak_bytes", "saved_bytes",
                  "held_bytes", "backward_peak_bytes"):  # fmt: skip
        assert getattr(measured_cold, field) == getattr(measured_warm, field), field
    assert measured_cold.nograd_peak_bytes < 4096 * 4


def test_uninitialized_lazy_parameters_are_named() -> None:
    chain = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.LazyLinear(4))
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"item 2 .*LazyLinear.*run one forward"):
        seqckpt.profile(chain, x, repeats=1)
    chain(x)  # initializes them
    assert len(seqckpt.profile(chain, x, repeats=1)) == 3


def test_policy_costs_include_the_forward_under_the_policy() -> None:
    from seqckpt.planner import ChainProfile

    chain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    prof = seqckpt.profile(
        chain, torch.randn(16, 32), repeats=2, policies=("compute_heavy",)
    )
    for layer in prof.layers:
        (cost,) = layer.policies
        assert cost.forward_time is not None and cost.forward_time > 0
        assert layer.forward_time_under(cost) == cost.forward_time
    again = ChainProfile.from_dict(prof.to_dict())
    assert again == prof
    # a profile written before the field: the plain forward's time stands in
    data = prof.to_dict()
    for row in data["layers"]:
        for cost in row["policies"]:
            del cost["forward_time"]
    old = ChainProfile.from_dict(data)
    for layer in old.layers:
        assert layer.policies[0].forward_time is None
        assert layer.forward_time_under(layer.policies[0]) == layer.forward_time


def test_autocasts_cached_casts_are_measured_apart() -> None:
    # Under autocast a checkpointed Linear leaves its bf16 weight and bias in
    # autocast's cache until the block ends (before backward): measured apart
    # from what a region keeps until its recompute, with and without a policy,
    # and read back from JSON (profiles written before the field read 0).
    from seqckpt.planner import ChainProfile

    chain = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prof = seqckpt.profile(chain, x, repeats=1, policies=("compute_heavy",))
    weights = 2 * (64 * 64 + 64)
    casts = [layer.region_cast_bytes for layer in prof.layers]
    assert casts == [weights, 0, weights]
    assert [layer.policies[0].cast_bytes for layer in prof.layers] == casts
    for layer in prof.layers:
        assert layer.region_kept_bytes >= layer.region_cast_bytes
        assert layer.policies[0].kept_bytes >= layer.policies[0].cast_bytes
    assert ChainProfile.from_dict(prof.to_dict()) == prof
    data = prof.to_dict()
    for row in data["layers"]:
        del row["region_cast_bytes"]
        del row["policies"][0]["cast_bytes"]
    old = ChainProfile.from_dict(data)
    assert all(layer.region_cast_bytes == 0 for layer in old.layers)
    assert all(layer.policies[0].cast_bytes == 0 for layer in old.layers)
    plain = seqckpt.profile(chain, x, repeats=1)
    assert all(layer.region_cast_bytes == 0 for layer in plain.layers)


def test_a_profile_under_fake_tensors_measures_the_same_bytes() -> None:
    # Under FakeTensorMode nothing is allocated and every data pointer reads 0:
    # storages must be told apart by identity, or the bytes a policy keeps
    # collapse into one storage (it read 0 kept bytes here). Times are not
    # meaningful there; the byte figures must equal a real profile's.
    from torch._subclasses.fake_tensor import FakeTensorMode

    def chain() -> nn.Sequential:
        return nn.Sequential(
            *[
                nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                for _ in range(3)
            ]
        )

    byte_fields = (
        "input_bytes", "output_bytes", "saved_bytes", "held_bytes",
        "forward_peak_bytes", "nograd_peak_bytes", "backward_peak_bytes",
        "returns_input",
    )  # fmt: skip
    real = seqckpt.profile(
        chain(), torch.randn(8, 16), policies=(None, "compute_heavy")
    )
    with FakeTensorMode():
        fake = seqckpt.profile(
            chain(), torch.randn(8, 16), policies=(None, "compute_heavy")
        )
    for a, b in zip(real.layers, fake.layers, strict=True):
        assert [getattr(a, f) for f in byte_fields] == [
            getattr(b, f) for f in byte_fields
        ]
        kept = [(c.policy, c.kept_bytes, c.keeps_output) for c in a.policies]
        assert kept == [(c.policy, c.kept_bytes, c.keeps_output) for c in b.policies]
        assert any(c.kept_bytes > 0 for c in a.policies)
