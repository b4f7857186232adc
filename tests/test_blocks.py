"""checkpoint_blocks: the innermost stacks of repeated blocks are checkpointed in
place (nn.Sequential stacks swapped, nn.ModuleList blocks given a checkpointed
forward), bitwise the plain run, with the model's keys and objects unchanged."""

from __future__ import annotations

import copy
import functools
import pickle
import runpy
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import seqckpt
from seqckpt import CheckpointedForward, CheckpointedSequential
from tests.counting import OpCounter
from tests.oracle import assert_matches_plain


def assert_blocks_match_plain(make: Callable[[], nn.Module]) -> None:
    """``checkpoint_blocks`` on a model from ``make`` trains bitwise like the
    plain model, on a batch of 8 rows of 6."""
    assert_matches_plain(
        make,
        torch.randn(8, 6, requires_grad=True),
        lambda m, t: seqckpt.checkpoint_blocks(m)(t),
    )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.GELU())
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.body(x))


class Net(nn.Module):
    """A stem, stages of repeated blocks, and a stack of stages."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Linear(6, 6), nn.Tanh())  # mixed: stays
        self.stages = nn.Sequential(
            nn.Sequential(Block(), Block(), Block()), nn.Sequential(Block(), Block())
        )
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def test_checkpoint_blocks_swaps_the_innermost_stacks_in_place() -> None:
    model = Net()
    blocks = list(model.stages.modules())
    keys = list(model.state_dict())
    assert seqckpt.checkpoint_blocks(model, segments=3, policy="compute_heavy") is model
    assert type(model.stem) is nn.Sequential and type(model.stages) is nn.Sequential
    stages = list(model.stages)
    assert all(isinstance(s, CheckpointedSequential) for s in stages)
    assert [s.segments for s in stages] == [3, 2]  # capped at each stack's length
    assert all(s.policy == stages[0].policy is not None for s in stages)
    assert [m for m in model.stages.modules() if not isinstance(m, nn.Sequential)] == [
        m for m in blocks if not isinstance(m, nn.Sequential)
    ]  # the same block objects
    assert list(model.state_dict()) == keys
    x = torch.randn(5, 6, requires_grad=True)
    assert_matches_plain(Net(), x, lambda m, t: seqckpt.checkpoint_blocks(m)(t))


class Wide(nn.Module):
    """A block whose activations are many times its input (as attention's
    and an MLP's are)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 256), nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def test_sequential_stacks_get_a_segment_per_block_by_default() -> None:
    # every block checkpointed, the last too, as timm's set_grad_checkpointing()
    # and HF's checkpointing do, and the blocks of nn.ModuleList stacks are;
    # before, about sqrt(n) segments (the last one plain), which kept several
    # blocks' activations: timm's convnext_atto 23.87 MiB against 11.96 by
    # timm's own route
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[Wide() for _ in range(9)])

    per_block = seqckpt.checkpoint_blocks(make())
    items = per_block.segments.items
    assert [(i.start, i.stop) for i in items] == [(i, i + 1) for i in range(9)]
    assert all(isinstance(i, seqckpt.planner.Recompute) for i in items)
    # printed in one line, not as the plan's dataclass tree
    assert "segments=<plan for modules 0-8, 9 checkpoints>" in repr(per_block)
    x = torch.randn(64, 8, requires_grad=True)
    peaks = []
    for model in (per_block, CheckpointedSequential.from_sequential(make())):
        for p in model.parameters():  # allocated first, as in a training loop
            p.grad = torch.zeros_like(p)
        with seqckpt.track_memory("cpu") as memory:
            model(x).sum().backward()
        peaks.append(memory.peak_bytes)
    assert peaks[0] < peaks[1]  # 3 segments: one plain, one recomputing 3 blocks
    for options in ({}, {"policy": "compute_heavy"}, {"policy": {torch.ops.aten.mm}}):
        assert_matches_plain(
            make, x, lambda m, t, o=options: seqckpt.checkpoint_blocks(m, **o)(t)
        )


def test_checkpoint_blocks_on_a_stack_itself_and_where_there_is_none() -> None:
    stack = nn.Sequential(Block(), Block())
    wrapped = seqckpt.checkpoint_blocks(stack, segments=2)
    assert type(wrapped) is CheckpointedSequential and wrapped.segments == 2
    assert list(wrapped) == list(stack)
    mixed = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    with pytest.warns(UserWarning, match="found no stack of repeated blocks"):
        assert seqckpt.checkpoint_blocks(mixed) is mixed
    assert type(mixed) is nn.Sequential
    model = seqckpt.checkpoint_blocks(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # swapped already: nothing to say
        seqckpt.checkpoint_blocks(model)
    # nor to swap: the stack of (now checkpointed) stacks stays as it is
    assert type(model.stages) is nn.Sequential


@pytest.mark.parametrize(
    ("model", "segments", "pattern"),
    [
        ("not a module", None, "argument 'model' must be an nn.Module"),
        (nn.Sequential(Block(), Block()), 0, "argument 'segments' must be an int"),
        (nn.Sequential(Block(), Block()), True, "argument 'segments' must be an int"),
    ],
)
def test_checkpoint_blocks_errors(model: Any, segments: Any, pattern: str) -> None:
    with pytest.raises((TypeError, ValueError), match=pattern):
        seqckpt.checkpoint_blocks(model, segments)


# ------------------------------------------------------ nn.ModuleList stacks


class Layer(nn.Module):
    """A transformer-ish layer called as HF calls its layers: a keyword
    argument, a tuple out, dropout inside; counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 6)
        self.norm = nn.LayerNorm(6)
        self.drop = nn.Dropout(0.2)
        self.forwards = 0

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.forwards += 1
        h = self.down(self.drop(torch.relu(self.up(self.norm(x)))))
        if scale is not None:
            h = h * scale
        return x + h, h.detach().abs().mean()


class LoopNet(nn.Module):
    """nanoGPT's shape: the forward loops over an nn.ModuleList of layers."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 6)
        self.layers = nn.ModuleList(Layer() for _ in range(n))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        scale = torch.full((6,), 0.5)
        for layer in self.layers:
            x, _ = layer(x, scale=scale)
        return self.head(x)


def test_module_list_blocks_are_checkpointed_in_place() -> None:
    model = LoopNet()
    layers, keys = list(model.layers), list(model.state_dict())
    assert seqckpt.checkpoint_blocks(model) is model
    assert type(model.layers) is nn.ModuleList and list(model.layers) == layers
    assert list(model.state_dict()) == keys
    assert all(isinstance(m.__dict__["forward"], CheckpointedForward) for m in layers)
    x = torch.randn(4, 6, requires_grad=True)
    model(x).sum().backward()  # each layer's forward runs again in backward
    assert [m.forwards for m in layers] == [2, 2, 2]
    assert_matches_plain(LoopNet(), x, lambda m, t: seqckpt.checkpoint_blocks(m)(t))


class Downsample(nn.Module):
    """One weight layer as a module of its own (diffusers' downsamplers hold
    one convolution so, in a list): a layer, not a block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class OneOf(nn.Module):
    """A model whose list holds one module, under a name of its choosing."""

    def __init__(self, name: str, member: nn.Module) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, nn.ModuleList([member]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in getattr(self, self.name):
            x = module(x)
        return x[0] if isinstance(x, tuple) else x


def test_a_list_of_one_block_is_a_stack_built_one_deep() -> None:
    # An HF model with num_hidden_layers=1, ALBERT's one shared layer group,
    # a diffusers transformer with one double-stream block: before, nothing
    # was checkpointed there ("found no stack"), while HF's and diffusers' own
    # checkpointing took the block (diffusers' HunyuanVideo with one
    # double-stream block, small config: 0.25 MiB, now 0.15 as its own route)
    model = seqckpt.checkpoint_blocks(LoopNet(1))
    assert isinstance(model.layers[0].__dict__.get("forward"), CheckpointedForward)
    assert_matches_plain(
        lambda: LoopNet(1),
        torch.randn(8, 6, requires_grad=True),
        lambda m, t: seqckpt.checkpoint_blocks(m)(t),
    )
    # not with a segment count (one block has no segment to checkpoint), nor
    # a list of one layer, nor a list of one expert
    for model, segments in (
        (LoopNet(1), 2),
        (OneOf("down", Downsample()), None),
        (OneOf("experts", Layer()), None),
    ):
        with pytest.warns(UserWarning, match="found no stack of repeated blocks"):
            seqckpt.checkpoint_blocks(model, segments)
        assert not any(
            isinstance(m.__dict__.get("forward"), CheckpointedForward)
            for m in model.modules()
        )


def test_segments_for_module_list_stacks_are_said_not_to_apply() -> None:
    model = LoopNet()
    with pytest.warns(UserWarning, match="segments=2 applies to nn.Sequential"):
        seqckpt.checkpoint_blocks(model, segments=2)
    assert all(
        isinstance(m.__dict__["forward"], CheckpointedForward) for m in model.layers
    )


def test_a_second_call_and_a_copy_checkpoint_once() -> None:
    model = seqckpt.checkpoint_blocks(LoopNet())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # done already: nothing to say or redo
        seqckpt.checkpoint_blocks(model)
    x = torch.randn(4, 6, requires_grad=True)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(m.__dict__["forward"].module is m for m in twin.layers)
        twin(x).sum().backward()
        assert [m.forwards for m in twin.layers] == [2, 2, 2]  # once each, again once
        assert all(p.grad is not None for p in twin.parameters())
        assert all(p.grad is None for p in model.parameters())


def test_module_list_blocks_run_plainly_in_eval_and_without_grad() -> None:
    model = seqckpt.checkpoint_blocks(LoopNet())
    x = torch.randn(4, 6, requires_grad=True)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x).sum().backward()
    assert [m.forwards for m in model.layers] == [2, 2, 2]  # no recompute


def test_module_list_blocks_take_the_options_and_keep_their_hooks() -> None:
    model = LoopNet()
    calls: list[int] = []
    model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    seqckpt.checkpoint_blocks(model, policy="compute_heavy")
    y = model(torch.randn(4, 6, requires_grad=True))
    with OpCounter() as counter:
        y.sum().backward()
    assert "addmm" not in counter.counts  # kept, not recomputed
    assert counter.counts["relu"] == 3  # each layer's activation, recomputed
    assert calls == [1]  # the block's own hook runs once, not in the recompute
    with pytest.raises(ValueError, match="argument 'determinism_check'"):
        seqckpt.checkpoint_blocks(LoopNet(), determinism_check="sometimes")
    with pytest.raises(TypeError, match="seqckpt: checkpoint_blocks got unknown op"):
        seqckpt.checkpoint_blocks(LoopNet(), polcy="compute_heavy")
    with pytest.raises(TypeError, match="seqckpt: CheckpointedForward got unknown"):
        CheckpointedForward(Layer(), segments=2)


def doubled_input(layer: Layer, x: torch.Tensor, scale: Any = None) -> Any:
    return Layer.forward(layer, 2 * x, scale)


def loop_net_with_a_forward_of_its_own() -> LoopNet:
    model = LoopNet()
    model.layers[1].forward = functools.partial(doubled_input, model.layers[1])
    return model


def test_a_block_with_a_forward_of_its_own_keeps_it() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    assert_matches_plain(
        loop_net_with_a_forward_of_its_own,
        x,
        lambda m, t: seqckpt.checkpoint_blocks(m)(t),
    )


def test_mixed_module_lists_are_not_stacks() -> None:
    mixed = nn.ModuleList([nn.Linear(6, 6), nn.ReLU()])
    with pytest.warns(UserWarning, match="found no stack of repeated blocks"):
        seqckpt.checkpoint_blocks(mixed)
    assert "forward" not in mixed[0].__dict__
    same = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
    seqckpt.checkpoint_blocks(same)  # the list itself is the stack
    assert all(isinstance(m.__dict__["forward"], CheckpointedForward) for m in same)


class Mixer(nn.Module):
    """A second kind of layer (Jamba interleaves Mamba layers like it with
    attention layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(x)


class Experts(nn.Module):
    """A mixture-of-experts layer as older HF models and hand-written ones
    have it: a router and an nn.ModuleList of experts, each token sent to one."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 3)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():
                out[picked] = expert(x[picked])
        return x + out


class SelectiveKernel(nn.Module):
    """SKNet's selective kernel: parallel paths of one input, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.paths = nn.ModuleList(ConvLayer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(path(x) for path in self.paths)


def test_hybrid_and_mixture_of_experts_stacks() -> None:
    # A ModuleList of blocks of two classes was no stack (nothing
    # checkpointed); in MoE layers the experts list was the innermost stack, so
    # each expert call became a region and the layers around were left alone;
    # likewise SKNet's parallel paths (timm's skresnet18 at 224x224, batch 2:
    # 79.15 -> 56.18 MiB, now 36.76, timm's own route 36.9)
    for blocks in (
        lambda: [Block(), Mixer(), Block(), Mixer()],
        lambda: [Experts(), Experts(), Experts()],
        lambda: [SelectiveKernel(), SelectiveKernel()],
    ):

        def make(blocks: Any = blocks) -> Loop:
            torch.manual_seed(0)
            return Loop(blocks())

        model = make()
        seqckpt.checkpoint_blocks(model)
        assert all(
            isinstance(m.__dict__.get("forward"), CheckpointedForward)
            == (m in list(model.stack))
            for m in model.modules()
        )
        assert_matches_plain(
            make,
            torch.randn(8, 6, requires_grad=True),
            lambda m, t: seqckpt.checkpoint_blocks(m)(t),
        )
    leaves = nn.ModuleList([nn.Linear(6, 6), nn.LayerNorm(6)])  # layers, not blocks
    with pytest.warns(UserWarning, match="found no stack of repeated blocks"):
        seqckpt.checkpoint_blocks(leaves)


def test_a_sequential_of_blocks_of_several_classes_is_a_stack() -> None:
    # torchvision's MobileNetV2 features and timm's RexNet: blocks of several
    # classes in one nn.Sequential were no stack, so nothing was checkpointed
    # (mobilenet_v2 at 128x128: 49.89 -> 49.89 MiB; now 14.26)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(Block(), Mixer(), Block(), Mixer())

    model = seqckpt.checkpoint_blocks(make())
    assert type(model) is CheckpointedSequential
    assert [(i.start, i.stop) for i in model.segments.items] == [
        (i, i + 1) for i in range(4)
    ]
    assert_blocks_match_plain(make)
    layers = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))  # layers, not blocks
    with pytest.warns(UserWarning, match="found no stack of repeated blocks"):
        seqckpt.checkpoint_blocks(layers)


def test_a_stage_of_one_block_beside_stages_of_several_is_taken() -> None:
    # timm's EfficientNet, MobileNetV3 and GhostNet start with stages of one
    # block, at the largest resolution: not stacks, so they were left plain
    # (timm ghostnet_050 at 224x224: 32.05 MiB; now 12.83, timm's own 12.91)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(Block()),
            nn.Sequential(Block(), Block()),
            nn.Sequential(Mixer()),
        )

    model = seqckpt.checkpoint_blocks(make())
    assert all(type(stage) is CheckpointedSequential for stage in model)
    assert [len(stage.segments.items) for stage in model] == [1, 2, 1]
    assert_blocks_match_plain(make)
    # with a segment count, as checkpoint_sequential: one block has no segment
    model = seqckpt.checkpoint_blocks(make(), segments=2)
    assert [type(stage) for stage in model] == [
        nn.Sequential,
        CheckpointedSequential,
        nn.Sequential,
    ]


class DenseLayer(nn.Module):
    """DenseNet's layer: takes the list of every earlier layer's features."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.proj = nn.BatchNorm1d(width), nn.Linear(width, 6)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.proj(torch.relu(self.norm(torch.cat(features, 1))))


class DenseStage(nn.ModuleDict):
    """torchvision's and timm's DenseNet block: an nn.ModuleDict subclass whose
    forward hands each layer the growing list of features."""

    def __init__(self, n: int = 3) -> None:
        super().__init__({f"layer{i}": DenseLayer(6 * (i + 1)) for i in range(n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class AnyStage(nn.Sequential):
    """torchvision's RegNet stage: an nn.Sequential subclass with attributes
    of its own."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__(*blocks)
        self.width = 6


def test_module_dicts_and_container_subclasses_are_stacks() -> None:
    # nn.ModuleDict and container subclasses were no stacks: nothing was
    # checkpointed in torchvision's DenseNet (densenet121 at 96x96, batch 2:
    # 46.24 -> 46.24 MiB; now 12.00) nor in timm's (248.57 -> 248.57; now
    # 55.66, timm's own route 120.3)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(DenseStage(), nn.Linear(24, 6), AnyStage(Block(), Block()))

    model = seqckpt.checkpoint_blocks(make())
    dense, stage = model[0], model[2]
    assert type(dense) is DenseStage and type(stage) is AnyStage  # kept in place
    for block in [*dense.values(), *stage]:
        assert isinstance(block.__dict__["forward"], CheckpointedForward)
    assert_blocks_match_plain(make)
    heads = nn.ModuleDict({"a": nn.Linear(6, 2), "b": nn.Linear(6, 2)})  # not a chain
    with pytest.warns(UserWarning, match="found no stack of repeated blocks"):
        seqckpt.checkpoint_blocks(heads)


class SplitBlock(nn.Module):
    """A Res2Net-style block: a few layers of its own in an nn.ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        a = self.convs[0](a).relu()
        b = self.convs[1](b + a).relu()
        return x + self.norm(torch.cat([a, b], dim=-1))


def test_layers_inside_blocks_leave_the_blocks_the_stack() -> None:
    # The blocks' own nn.ModuleList of layers was the innermost stack: one
    # region per layer call, the stage of blocks left alone (no memory saved).
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(6, 6), nn.Sequential(*[SplitBlock() for _ in range(4)])
        )

    model = make()
    for _ in range(2):  # a second call changes nothing
        seqckpt.checkpoint_blocks(model, segments=2)
        assert type(model[1]) is CheckpointedSequential
        # the stack's blocks hold one (for a parent that loops over them),
        # nothing inside them does
        assert {
            id(m)
            for m in model.modules()
            if isinstance(m.__dict__.get("forward"), CheckpointedForward)
        } == set(map(id, model[1]))
    assert_matches_plain(
        make,
        torch.randn(8, 6, requires_grad=True),
        lambda m, t: seqckpt.checkpoint_blocks(m, segments=2)(t),
    )


class ConvLayer(nn.Module):
    """A layer of a block that HF wraps in a module: linear, norm, activation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).relu()


class Bottleneck(nn.Module):
    """HF ResNet's block: its layers run as an nn.Sequential stack of their own,
    then the residual add and activation."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layer = nn.Sequential(*[ConvLayer() for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.layer(x)).relu()


class Stage(nn.Module):
    def __init__(self, depth: int, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[Bottleneck(layers) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_stacks_three_deep_take_the_middle_one() -> None:
    # stages -> each stage's blocks -> each block's layers: the layers were the
    # innermost stack, so each block's residual add and activation stayed
    # outside every region (HF ResNet-50: 22.40 -> 21.21 MiB; now 14.11)
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.ModuleList([Stage(3), Stage(2)])

    model = seqckpt.checkpoint_blocks(make())
    assert all(type(stage.layers) is CheckpointedSequential for stage in model)
    assert not any(
        type(m) is CheckpointedSequential or m.__dict__.get("forward") is not None
        for stage in model
        for block in stage.layers
        for m in block.modules()
        if m is not block
    )
    # two deep, the inner one where it is a stack of blocks in its own right
    # (ConvNeXt's stages of blocks look the same as one such stage alone),
    # the outer one where the inner stacks are a block's few layers (three
    # weight layers or fewer)
    stage = seqckpt.checkpoint_blocks(Stage(3, layers=4))
    assert type(stage.layers) is nn.Sequential
    assert all(type(block.layer) is CheckpointedSequential for block in stage.layers)
    stage = seqckpt.checkpoint_blocks(Stage(3))
    assert type(stage.layers) is CheckpointedSequential
    assert all(type(block.layer) is nn.Sequential for block in stage.layers)

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for stage in m:
            x = stage(x)
        return x

    assert_matches_plain(
        make,
        torch.randn(8, 6, requires_grad=True),
        lambda m, x: run(seqckpt.checkpoint_blocks(m), x),
        run,
    )


def test_a_stack_inside_a_few_of_the_blocks_leaves_the_blocks_the_stack() -> None:
    # Xception's last block runs its convolutions as a stack, its others as
    # layers: that one inner stack was taken and the other blocks left plain
    # (timm's xception41 at 299x299, batch 2: 630.49 -> 607.79 MiB; now 236.22,
    # timm's own route 253.1)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(Block(), Block(), Block(), Bottleneck())

    model = seqckpt.checkpoint_blocks(make())
    assert type(model) is CheckpointedSequential
    assert type(model[3].layer) is nn.Sequential  # the block's own layers
    assert_blocks_match_plain(make)
    # in most of the blocks, the inner stacks are the stacks (as before)
    inner = seqckpt.checkpoint_blocks(
        nn.Sequential(Bottleneck(4), Bottleneck(4), Block())
    )
    assert type(inner) is nn.Sequential
    assert all(type(b.layer) is CheckpointedSequential for b in inner[:2])


def test_a_stage_of_one_block_with_a_stack_inside_is_the_region() -> None:
    # torchvision's RegNet starts with a stage of one block whose layers are a
    # stack: the layers were taken, the block's shortcut and add left plain
    # (regnet_y_400mf at 64x64, batch 2: 6.06 -> 2.29 MiB; now 2.19)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(Bottleneck()), nn.Sequential(Bottleneck(), Bottleneck())
        )

    model = seqckpt.checkpoint_blocks(make())
    assert [type(stage) for stage in model] == [CheckpointedSequential] * 2
    assert type(model[0][0].layer) is nn.Sequential
    assert_blocks_match_plain(make)


class RegStage(nn.Module):
    """timm's RegNet stage: blocks held as numbered attributes, looped over."""

    def __init__(self, depth: int, block: type[nn.Module] = Block) -> None:
        super().__init__()
        for i in range(depth):
            self.add_module(f"b{i + 1}", block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.children():
            x = block(x)
        return x


class TwoConvs(nn.Module):
    """A block whose two layers are numbered attributes of one class."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = ConvLayer(), ConvLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.conv1(x))


def test_numbered_blocks_held_as_attributes_are_a_stack() -> None:
    # timm's RegNet holds each stage's blocks as b1, b2, ...: nothing was
    # checkpointed (regnety_040_sgn at 224x224, batch 2: 297.91 -> 297.91 MiB;
    # now 76.57, timm's own route 76.6)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(RegStage(3), nn.Linear(6, 6), RegStage(2))

    model = seqckpt.checkpoint_blocks(make())
    assert type(model[0]) is RegStage
    assert all(
        isinstance(b.__dict__["forward"], CheckpointedForward)
        for stage in (model[0], model[2])
        for b in stage.children()
    )
    assert_blocks_match_plain(make)
    # a block's numbered layers do not stop its own stack from being taken
    blocks = seqckpt.checkpoint_blocks(nn.Sequential(TwoConvs(), TwoConvs()))
    assert type(blocks) is CheckpointedSequential
    assert not any("forward" in m.__dict__ for b in blocks for m in b.children())


class NumberedStages(nn.Module):
    """timm's ResNet and RegNet hold their stages as numbered attributes
    (``layer1`` ..., ``s1`` ...), the first of one block in small models."""

    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, 6)
        self.layer1, self.layer2 = nn.Sequential(block()), nn.Sequential(block())
        self.s1, self.s2 = RegStage(1, block), RegStage(2, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.s2(self.s1(self.layer2(self.layer1(self.stem(x)))))


@pytest.mark.parametrize("block", [Block, Bottleneck])
def test_numbered_stages_of_one_block_are_taken(block: type[nn.Module]) -> None:
    # timm's resnest14d (one block per stage) and the first stages of its
    # regnety_002 were left plain (resnest14d at 224x224, batch 2: 124.28 ->
    # 124.28 MiB, now 75.06; regnety_002 at 96x96 7.01 -> 4.59, now 3.38 as
    # with timm's own route)
    # (with blocks of three weight layers the stages are numbered blocks of
    # the model too: a stage's block is the region all the same)
    model = seqckpt.checkpoint_blocks(NumberedStages(block))
    assert type(model.layer1) is CheckpointedSequential
    assert type(model.layer2) is CheckpointedSequential
    assert isinstance(model.s1.b1.__dict__["forward"], CheckpointedForward)
    assert "forward" not in model.s1.__dict__
    assert_blocks_match_plain(functools.partial(NumberedStages, block))


class Inception(nn.Module):
    """GoogLeNet's block: branches side by side, two of them two-layer stacks."""

    def __init__(self) -> None:
        super().__init__()
        self.branch1 = ConvLayer()
        self.branch2 = nn.Sequential(ConvLayer(), ConvLayer())
        self.branch3 = nn.Sequential(ConvLayer(), ConvLayer())
        self.mix = nn.Linear(18, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [self.branch1(x), self.branch2(x), self.branch3(x)]
        return x + self.mix(torch.cat(branches, dim=1))


class GoogLeNetLike(nn.Module):
    """Blocks held as numbered attributes beside a stem and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = ConvLayer(), ConvLayer()
        self.inception3a, self.inception3b = Inception(), Inception()
        self.inception4a = Inception()
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inception3b(self.inception3a(self.conv2(self.conv1(x))))
        return self.head(self.inception4a(x.tanh()))


def test_numbered_blocks_beside_other_attributes_are_taken() -> None:
    # GoogLeNet holds its Inception blocks as inception3a ... inception5b
    # beside its stem and head, InceptionV3 as Mixed_5b ...: only the
    # two-layer branches were taken (torchvision googlenet at 128x128, batch
    # 2: 32.27 -> 27.83 MiB; now 17.62; inception_v3 at 299x299 191.53 ->
    # 191.53, now 116.39)
    model = seqckpt.checkpoint_blocks(GoogLeNetLike())
    for name in ("inception3a", "inception3b", "inception4a"):
        block = getattr(model, name)
        assert isinstance(block.__dict__.get("forward"), CheckpointedForward)
        assert type(block.branch2) is nn.Sequential  # inside a region: plain
    # a stem's numbered layers (one weight layer each) are no blocks
    assert "forward" not in model.conv1.__dict__
    assert_blocks_match_plain(GoogLeNetLike)


def blocks_trunk() -> nn.Sequential:
    """SqueezeNet's and DPN's features: blocks with single layers between."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), Block(), Block(), nn.Tanh(), Block(), nn.Dropout(0.1)
    )


def inception_trunk() -> nn.Sequential:
    """S3D's features: Inception blocks and a separable convolution (two
    layers as a stack) between single layers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(ConvLayer(), ConvLayer()),
        nn.Tanh(),
        Inception(),
        Inception(),
        nn.Dropout(0.1),
        Inception(),
    )


@pytest.mark.parametrize(
    ("trunk", "regions"),
    [
        (blocks_trunk, [(0, 1), (1, 2), (2, 4), (4, 6)]),
        (inception_trunk, [(0, 2), (2, 3), (3, 5), (5, 6)]),
    ],
)
def test_a_trunk_of_blocks_between_single_layers_is_a_stack(
    trunk: Callable[[], nn.Sequential], regions: list[tuple[int, int]]
) -> None:
    # Such trunks were no stack, so nothing was checkpointed (squeezenet1_0 at
    # 128x128, batch 2: 20.66 -> 20.66 MiB; now 11.64; timm's dpn68 at
    # 224x224: 183.04 -> 183.04; now 43.13, timm's own route 44.6); where
    # blocks hold small stacks, those were taken and the blocks' other layers
    # left plain (torchvision s3d, 16 frames of 224x224, batch 1: 459.23 ->
    # 301.39 MiB; now 196.00)
    def make() -> nn.Sequential:
        return nn.Sequential(trunk(), nn.Linear(6, 2))

    # (a layer without parameters joins the region before it: a region of
    # its own would keep its input beside the next region's: squeezenet1_0
    # 11.64 MiB then, 9.23 now)
    model = seqckpt.checkpoint_blocks(make())
    assert type(model[0]) is CheckpointedSequential
    assert [(i.start, i.stop) for i in model[0].segments.items] == regions
    assert_blocks_match_plain(make)
    # inside a stack of blocks such a list is a block's own layers
    stack = seqckpt.checkpoint_blocks(nn.Sequential(trunk(), trunk()))
    assert type(stack) is CheckpointedSequential
    assert all(type(t) is nn.Sequential for t in stack)


class ConvHead(nn.Sequential):
    """torchvision's FastRCNNConvFCHead: an nn.Sequential subclass of conv
    blocks, a flatten and a linear layer, and an in-place ReLU."""


def test_a_trunk_of_a_sequential_subclass_makes_its_blocks_regions() -> None:
    # the box head of torchvision's v2 R-CNNs was not taken (a subclass);
    # taken, its blocks are the regions (its in-place ReLU cannot be one)
    # (fasterrcnn_resnet50_fpn_v2, two 128x128 images: 612.74 -> 573.55 MiB;
    # now 422.55)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        head = ConvHead(Block(), Block(), nn.Linear(6, 6), nn.ReLU(inplace=True))
        return nn.Sequential(head, nn.Linear(6, 2))

    model = seqckpt.checkpoint_blocks(make())
    head = model[0]
    assert type(head) is ConvHead
    assert all(isinstance(b.__dict__["forward"], CheckpointedForward) for b in head[:2])
    assert not any("forward" in layer.__dict__ for layer in head[2:])
    assert_blocks_match_plain(make)


class Tree(nn.Module):
    """DLA's tree: two subtrees (or blocks) held as tree1 and tree2."""

    def __init__(self, levels: int) -> None:
        super().__init__()
        self.tree1 = Tree(levels - 1) if levels > 1 else Bottleneck()
        self.tree2 = Tree(levels - 1) if levels > 1 else Bottleneck()
        self.root = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = self.tree1(x)
        return self.root(torch.cat([left, self.tree2(left)], dim=1))


def test_numbered_blocks_inside_numbered_blocks_are_the_ones_taken() -> None:
    # DLA's trees hold trees as tree1 and tree2, the innermost two blocks:
    # nothing was checkpointed (timm's dla34 at 224x224, batch 2: 97.86 ->
    # 97.86 MiB; now 73.37)
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(Tree(2), nn.Linear(6, 2))

    model = seqckpt.checkpoint_blocks(make())
    tree = model[0]
    assert not any("forward" in t.__dict__ for t in (tree, tree.tree1, tree.tree2))
    leaves = [sub.tree1 for sub in (tree.tree1, tree.tree2)] + [
        sub.tree2 for sub in (tree.tree1, tree.tree2)
    ]
    assert all(isinstance(b.__dict__["forward"], CheckpointedForward) for b in leaves)
    assert_blocks_match_plain(make)


class SharedEncodings(nn.Module):
    """CoaT: position encodings held as pos1, pos2 by the model and also by
    the blocks of each stage, which call them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos1, self.pos2 = Bottleneck(), Bottleneck()
        self.stage1 = nn.ModuleList(Encoded(self.pos1) for _ in range(2))
        self.stage2 = nn.ModuleList(Encoded(self.pos2) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.stage1, *self.stage2]:
            x = block(x)
        return x


class Encoded(nn.Module):
    def __init__(self, pos: nn.Module) -> None:
        super().__init__()
        self.pos, self.lin = pos, nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.pos(x)).tanh()


def test_a_module_shared_with_blocks_taken_is_not_taken_too() -> None:
    # taken as numbered blocks and run inside the blocks' regions, the
    # encodings would be regions nested in regions
    model = seqckpt.checkpoint_blocks(SharedEncodings())
    shared = [*model.pos1.modules(), *model.pos2.modules()]
    assert not any("forward" in m.__dict__ for m in shared)
    assert all(
        isinstance(b.__dict__["forward"], CheckpointedForward)
        for b in [*model.stage1, *model.stage2]
    )
    assert_blocks_match_plain(SharedEncodings)


class LoopedStage(nn.Module):
    """A stage that loops over its nn.Sequential of blocks instead of calling
    it (HF ResNet, BiT and CvT stages: ``for layer in self.layers``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[Block() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _gelus_in_backward(model: nn.Module, x: torch.Tensor) -> int:
    y = model(x)
    with OpCounter() as counter:
        y.sum().backward()
    return counter.counts["gelu"]


def test_a_sequential_stack_a_parent_loops_over_is_checkpointed() -> None:
    # The stack became a CheckpointedSequential whose forward the loop never
    # calls: nothing was checkpointed (HF ResNet-50's peak unchanged). Its
    # blocks now checkpoint themselves where the stack does not run them.
    x = torch.randn(8, 6, requires_grad=True)
    assert_matches_plain(LoopedStage(), x, lambda m, t: seqckpt.checkpoint_blocks(m)(t))
    looped = seqckpt.checkpoint_blocks(LoopedStage())
    assert isinstance(looped.layers, CheckpointedSequential)
    assert _gelus_in_backward(looped, x) == 4  # every block recomputed
    peaks = []
    for model in (LoopedStage(), looped):
        with seqckpt.track_memory() as mem:
            model(torch.randn(64, 6, requires_grad=True)).sum().backward()
        peaks.append(mem.peak_bytes)
    assert peaks[1] < peaks[0], peaks
    # called as a whole, the stack checkpoints its segments, and its blocks
    # are not regions of their own inside them nor in its plain last segment
    called = seqckpt.checkpoint_blocks(
        nn.Sequential(nn.Linear(6, 6), LoopedStage().layers), segments=2
    )
    assert _gelus_in_backward(called, x) == 2  # the first segment's two blocks


def test_a_swapped_stack_still_scripts_to_its_plain_forward() -> None:
    # (its blocks' forward for a loop over the stack is dropped for it: the
    # stack's own segments stay checkpointed)
    model = seqckpt.checkpoint_blocks(Net())
    block = model.stages[0][0]
    assert isinstance(block.__dict__["forward"], CheckpointedForward)
    scripted = torch.jit.script(model.eval())
    x = torch.randn(5, 6)
    assert torch.equal(scripted(x), Net().eval()(x))
    assert model.stages[0][0] is block and "forward" not in block.__dict__
    assert isinstance(model.stages[0], CheckpointedSequential)


class Loop(nn.Module):
    """A model whose forward loops over its blocks in an nn.ModuleList (the
    distributed tests' model too)."""

    def __init__(self, blocks: Iterable[nn.Module]) -> None:
        super().__init__()
        self.stack = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.stack:
            x = block(x)
        return x


def scripted_loop() -> Loop:
    # GELU, not Tanh: TorchScript's optimised executor differentiates tanh with
    # its own formula, so two plain runs of fresh scripted tanh blocks already
    # differ in the last bit (whichever compiled graph its cache hands out)
    torch.manual_seed(0)
    return Loop(
        [torch.jit.script(nn.Sequential(nn.Linear(6, 6), nn.GELU())) for _ in range(3)]
    )


def test_scripted_blocks_are_checkpointed_and_scripting_after_is_refused() -> None:
    model = seqckpt.checkpoint_blocks(scripted_loop())
    y = model(torch.randn(4, 6, requires_grad=True))
    with OpCounter() as counter:
        y.sum().backward()
    assert counter.counts["addmm"] == 3  # each block's linear, recomputed
    torch.jit.script(model)  # its blocks are compiled already: fine
    x = torch.randn(4, 6, requires_grad=True)
    assert_matches_plain(scripted_loop, x, lambda m, t: seqckpt.checkpoint_blocks(m)(t))
    with pytest.raises(TypeError, match="seqckpt: torch.jit.script cannot compile"):
        torch.jit.script(seqckpt.checkpoint_blocks(LoopNet()))


@pytest.mark.parametrize("flag", ["gradient_checkpointing", "grad_checkpointing"])
def test_a_model_checkpointing_itself_is_warned_about(flag: str) -> None:
    # HF's layers carry gradient_checkpointing, timm's models grad_checkpointing:
    # with either on, checkpoint_blocks would nest checkpoints
    model = LoopNet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seqckpt.checkpoint_blocks(LoopNet())  # flags off (or absent): quiet
    setattr(model.layers[0] if flag.startswith("gradient") else model, flag, True)
    with pytest.warns(UserWarning, match="has its own checkpointing on"):
        seqckpt.checkpoint_blocks(model)


def test_the_example_replacing_a_models_stacks() -> None:
    path = Path(__file__).parent.parent / "examples" / "replace_sequential.py"
    result = runpy.run_path(str(path))
    assert result["same"] is True
    assert result["gpt_peak"] < 0.5 * result["plain_peak"]  # four blocks, one live


def test_data_parallel_replicas_run_themselves() -> None:
    # nn.DataParallel copies each module's attributes into a replica per
    # device: a replica's forward must run the replica (its device's
    # parameters), not the block it was copied from
    model = seqckpt.checkpoint_blocks(LoopNet())
    block = model.layers[0]
    replica = block._replicate_for_data_parallel()
    assert replica is not block and replica.__dict__["forward"].module is replica
    assert block.__dict__["forward"].module is block
    assert replica.__dict__["forward"].options is block.__dict__["forward"].options
    again = replica._replicate_for_data_parallel()  # (replicas of replicas too)
    assert again.__dict__["forward"].module is again


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_data_parallel_over_two_gpus() -> None:
    x = torch.randn(8, 6, device="cuda", requires_grad=True)
    grads = []
    for checkpointed in (False, True):
        model = LoopNet().cuda().eval()  # eval: dropout would draw per device
        model.layers.train()  # ... but the blocks checkpoint in training mode
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        if checkpointed:
            seqckpt.checkpoint_blocks(model)
        nn.DataParallel(model)(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b) for a, b in zip(*grads, strict=True))
