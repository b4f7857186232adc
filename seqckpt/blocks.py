"""Checkpointing the stacks of repeated blocks in an existing model, in place:
:func:`checkpoint_blocks`.

Two kinds of stack are found. An ``nn.Sequential`` of blocks is called as a
whole, so it becomes a :class:`~seqckpt.CheckpointedSequential` over the same
blocks (each block checkpointed on its own, or in segments). An
``nn.ModuleList`` or ``nn.ModuleDict`` of blocks, or a container subclass, is
looped over by its parent's forward or its own (nanoGPT's ``h``,
torchvision's MaxViT and DenseNet, most hand-written transformers), which
seqckpt does not rewrite: there each block's own forward is made a region, by
a :class:`CheckpointedForward` set on the block, so the loop, the block's
attributes and every ``state_dict`` key stay as they were.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, TypeGuard

import torch
from torch import nn

from seqckpt._options import Options, make_options
from seqckpt._state import is_checkpointing, is_recomputing
from seqckpt.checkpoint import run_region
from seqckpt.executor import each_item_plan
from seqckpt.policies import as_policy
from seqckpt.sequential import CheckpointedSequential, called_by_its_stack

__all__ = ["CheckpointedForward", "checkpoint_blocks"]


class CheckpointedForward:
    """A module's forward, checkpointed: set as the module's ``forward``
    (:func:`checkpoint_blocks` does it for the blocks of ``nn.ModuleList``
    stacks), so each call of the module (through ``nn.Module.__call__``, with
    its hooks) runs as one region in training mode with grad enabled, and
    plainly otherwise. The recompute runs the module's own forward, not its
    hooks: they run once per call, as without checkpointing. Set on one
    module, it is seqckpt's stand-in for
    ``torch.distributed._composable.checkpoint(module)``: the module keeps its
    place, name and ``state_dict`` keys (no wrapper).

    Args:
        module: the module whose forward it replaces (the class's, or one the
            module holds as an attribute already).
        **options: keywords of :func:`seqckpt.checkpoint` for its regions
            (``policy``, ``determinism_check``, ``preserve_rng_state``, ...).

    Example:
        >>> import torch, seqckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        >>> block.forward = seqckpt.CheckpointedForward(block, policy="compute_heavy")
        >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """

    __slots__ = ("module", "options", "forward", "in_sequential")

    def __init__(self, module: nn.Module, **options: Any) -> None:
        self._bind(module, _checked_options(options, "CheckpointedForward"))

    @classmethod
    def _with_options(
        cls, module: nn.Module, options: Options, in_sequential: bool = False
    ) -> CheckpointedForward:
        """One for ``module`` with options checked already (``in_sequential``:
        a block of a swapped stack, see ``__call__``)."""
        made = cls.__new__(cls)
        made._bind(module, options)
        made.in_sequential = in_sequential
        return made

    def _bind(self, module: nn.Module, options: Options) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                "seqckpt: CheckpointedForward takes the nn.Module whose forward it "
                f"replaces, got {type(module).__name__}."
            )
        self.module = module
        self.options = options
        # a block of a stack swapped for a CheckpointedSequential, which
        # checkpoints only where a parent loops over the stack's blocks
        self.in_sequential = False
        own = module.__dict__.get("forward")
        # (set again on a module that has one already, or on a DataParallel
        # replica, which copied its block's: it replaces that one)
        self.forward = None if isinstance(own, CheckpointedForward) else own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.forward
        if forward is None:
            # (a partial while dynamo traces: torch 2.8's cannot trace __get__)
            forward = (
                functools.partial(type(module).forward, module)
                if torch.compiler.is_compiling()
                else type(module).forward.__get__(module)
            )
        if not (module.training and torch.is_grad_enabled()) or (
            self.in_sequential and _run_by_its_stack(module)
        ):
            return forward(*args, **kwargs)
        return run_region(
            forward, args, kwargs, self.options, [module], type(module).__name__
        )

    def __repr__(self) -> str:
        return f"CheckpointedForward({type(self.module).__name__})"


def checkpoint_blocks(
    model: nn.Module, segments: int | None = None, **options: Any
) -> nn.Module:
    """Checkpoint the stacks of repeated blocks inside ``model``, in place.

    A stack is an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``
    (or a subclass: torchvision's RegNet stages and DenseNet blocks) whose
    children are two or more modules of one class (blocks, for a dict), or
    two or more blocks (modules with submodules) of several classes (a hybrid
    stack: Jamba's Mamba and attention layers, MobileNetV2's ``features``); a
    list of routed experts or parallel paths (an ``nn.ModuleList`` named
    ``experts``, ``paths`` or the like) is not one. Where no stack encloses
    them, three more kinds count: blocks of one class held as numbered
    attributes (``b1``, ``b2``, ...: timm's RegNet stages; beside other
    attributes, blocks of two weight layers or more: GoogLeNet's
    ``inception3a`` ..., DLA's ``tree1`` and ``tree2``); an ``nn.Sequential``
    or ``nn.ModuleList`` of blocks with single layers between them, no fewer
    blocks than layers (SqueezeNet's, DPN's and S3D's ``features``; inside a
    block such a list is the block's own layers); and, unless ``segments``
    is given, one of a single block of two weight layers or more, a stack
    built one deep (an HF model with ``num_hidden_layers=1``, ALBERT's shared
    layer group). Only the innermost stacks are taken (a stack holding
    stacks, such as ConvNeXt's ``stages``, stays as it is), so checkpoints
    do not nest; a stack of three weight layers or fewer inside a block
    (an Inception block's two-convolution branches) is the block's own
    layers, not a stack of its own; where stacks nest
    three deep (HF's ResNet: stages, each a stack of blocks, each block
    running its layers as a stack) the middle one is taken, the innermost
    being a block's own layers. Among stages (a container of such containers,
    as timm's EfficientNet ``blocks``, or stages held as numbered attributes:
    ResNet's ``layer1`` to ``layer4``), a stage of one block is taken too,
    unless ``segments`` is given.
    Parameters, optimisers and ``state_dict`` keys are unchanged: the same
    block objects stay where they were.

    - ``nn.Sequential`` stacks (torchvision's ResNet stages, timm's ViT
      ``blocks``) become :class:`CheckpointedSequential` s over their blocks,
      every block its own segment unless ``segments`` says otherwise (a
      layer without parameters between blocks, a pooling layer or an
      activation, runs in the segment before it; in a container subclass
      kept in place, single layers run plainly).
    - ``nn.ModuleList`` and ``nn.ModuleDict`` stacks and container
      subclasses (nanoGPT's ``transformer.h``, torchvision's MaxViT
      ``layers``, DenseNet's blocks) are looped over by the parent's forward
      or their own and stay in place: each block gets a
      :class:`CheckpointedForward`, so every call of it is a region of its
      own (``segments`` does not apply, and a warning says so; the block's
      hooks run once per call). Arguments and results may be anything a
      region takes (keywords, tuples, the list of features DenseNet's layers
      take).

    This is seqckpt's stand-in for timm's ``model.set_grad_checkpointing()``
    and HF's ``gradient_checkpointing_enable()``; leave those off (it warns
    where one is on: the blocks would be checkpointed twice, nested). A
    key/value cache given to a block is filled once, as without checkpointing
    (its recompute runs on a copy of the cache as it was); ``use_cache=False``
    in training, as HF's own checkpointing sets, still saves the cache's memory.

    Args:
        model: any module.
        segments: segments per ``nn.Sequential`` stack, at most the stack's
            length, all but the last checkpointed (as
            :func:`checkpoint_sequential`); None (the default): every block
            checkpointed on its own, the last too, as timm's
            ``set_grad_checkpointing()`` and HF's own checkpointing do and as
            the blocks of ``nn.ModuleList`` stacks are (a plain last block
            would keep its activations until backward, one per stack).
        **options: checkpoint options for every stack (``policy``,
            ``determinism_check``, ``preserve_rng_state``, ``context_fn``, ...).

    Returns:
        ``model``; where ``model`` is itself an ``nn.Sequential`` stack, a new
        :class:`CheckpointedSequential` over its modules. Where it holds no
        stack (torchvision's VGG ``features`` mixes layers of several classes),
        it warns that nothing is checkpointed.

    Example:
        >>> import torch, seqckpt
        >>> stage = lambda: torch.nn.Sequential(
        ...     *[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        ...       for _ in range(4)])
        >>> model = torch.nn.Sequential(stage(), torch.nn.Linear(8, 8), stage())
        >>> _ = seqckpt.checkpoint_blocks(model, segments=2)
        >>> [type(m).__name__ for m in model]
        ['CheckpointedSequential', 'Linear', 'CheckpointedSequential']
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> _ = seqckpt.checkpoint_blocks(layers)
        >>> layers[0].forward
        CheckpointedForward(Linear)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"seqckpt: argument 'model' must be an nn.Module, got "
            f"{type(model).__name__}."
        )
    if segments is not None and (
        isinstance(segments, bool) or not isinstance(segments, int) or segments < 1
    ):
        raise ValueError(
            f"seqckpt: argument 'segments' must be an int >= 1 or None, got "
            f"{segments!r}."
        )

    def swapped(stack: nn.Sequential) -> CheckpointedSequential:
        if segments is not None:
            k = min(segments, len(stack))
            return CheckpointedSequential.from_sequential(stack, k, **options)
        # every block a region of its own, as timm's and HF's own give: with
        # the last plain (checkpoint_sequential's way) each stack of a model
        # would keep one block's activations until backward
        plan = each_item_plan(
            list(stack), as_policy(options.get("policy")), joins=_plain_layer
        )
        rest = {k: v for k, v in options.items() if k != "policy"}
        return CheckpointedSequential.from_sequential(stack, plan, **rest)

    # (an error in the options shows here, before anything is changed)
    block_options = _checked_options(
        {k: v for k, v in options.items() if k != "memory_budget"},
        "checkpoint_blocks",
    )
    bodies = _block_bodies(model)
    innermost = _is_innermost_stack(model, bodies=bodies)
    if innermost and _swappable(model):
        assert isinstance(model, nn.Sequential)
        return swapped(model)
    sequentials: list[tuple[nn.Module, str, nn.Sequential]] = []
    lists: list[nn.Module] = []  # stacks looped over (or called) as they are
    # What lies inside a stack taken or a module checkpointed already (a stack
    # of layers inside a block: Res2Net's convs) is not taken: no nesting.
    covered = {
        id(inner)
        for m in model.modules()
        if (m is model and innermost) or _checkpointed(m)
        for inner in m.modules()
        if inner is not m
    }
    singles: list[nn.Module] = []  # blocks held as numbered attributes
    for parent in model.modules():
        if id(parent) in covered:
            continue  # (and so are its children)
        stages = segments is None and _holds_stages(parent)
        numbered = _numbered_children(parent)
        for name, child in parent.named_children():
            if id(child) in covered:
                continue
            single = name in numbered and _holds_no_numbered(child, bodies)
            if not (
                single
                or _is_innermost_stack(child, name, bodies)
                or (stages and _is_lone_block(child, bodies))
                or (_blocks_between_layers(child) and _nothing_inside(child, bodies))
                or (
                    segments is None
                    and _holds_one_block(child, name)
                    and _nothing_inside(child, bodies)
                )
            ):
                continue
            covered.update(id(inner) for inner in child.modules() if inner is not child)
            if single:
                singles.append(child)
            elif _swappable(child):
                assert isinstance(child, nn.Sequential)
                sequentials.append((parent, name, child))
            else:
                lists.append(child)
    # A module taken and also inside one taken after it (shared between them:
    # CoaT's position encodings, held by the model and by its blocks) would
    # nest: the enclosing one is kept.
    sequentials = [s for s in sequentials if id(s[2]) not in covered]
    lists = [m for m in lists if id(m) not in covered]
    singles = [m for m in singles if id(m) not in covered]
    if innermost:
        lists.append(model)  # its blocks are what changes
    if not (sequentials or lists or singles) and not any(
        map(_checkpointed, model.modules())
    ):
        warnings.warn(
            f"seqckpt: checkpoint_blocks found no stack of repeated blocks (an "
            f"nn.Sequential, nn.ModuleList or nn.ModuleDict of two or more modules "
            f"of one class, or of blocks of several) in "
            f"{type(model).__name__}, so nothing is checkpointed. Swap "
            "its trunk yourself, e.g. model.features = "
            "CheckpointedSequential.from_sequential(model.features), or call "
            "seqckpt.checkpoint(block, x) in its forward.",
            stacklevel=2,
        )
    if segments is not None and lists:
        warnings.warn(
            f"seqckpt: segments={segments} applies to nn.Sequential stacks; the "
            f"other stacks in {type(model).__name__} (nn.ModuleList, "
            "nn.ModuleDict, container subclasses) are looped over by its own "
            "code, so each of their blocks is a region of its own.",
            stacklevel=2,
        )
    own = next((m for m in model.modules() if _checkpoints_itself(m)), None)
    if own is not None and (sequentials or lists or singles):
        warnings.warn(
            f"seqckpt: {type(own).__name__} in {type(model).__name__} has its own "
            "checkpointing on (the gradient_checkpointing flag of HF transformers "
            "and diffusers, or timm's grad_checkpointing), so its blocks would be "
            "checkpointed twice, nested (each recompute run again inside another). "
            "Turn that off (model.gradient_checkpointing_disable() or "
            "disable_gradient_checkpointing(), or set_grad_checkpointing(False)) "
            "and keep checkpoint_blocks, or use the library's own with "
            "seqckpt as its checkpoint function (see the README).",
            stacklevel=2,
        )
    for parent, name, stack in sequentials:
        setattr(parent, name, swapped(stack))
        # Some parents loop over the stack instead of calling it (HF ResNet,
        # BiT and CvT stages: for layer in self.layers), which the swap alone
        # leaves plain: there each block is a region of its own.
        for block in stack:
            _give_checkpointed_forward(block, block_options, in_sequential=True)
    for looped in lists:
        # every module of a stack; elsewhere (a trunk of blocks with single
        # layers between them, a stage of one block) the blocks: a single
        # layer as a region saves little or adds (an activation's region keeps
        # its input, the next block's its output), and one that writes into
        # its input (nn.ReLU(inplace=True)) cannot be one
        every = _is_stack(looped)
        for member in looped._modules.values():
            assert member is not None
            if every or _is_block(member):
                _give_checkpointed_forward(member, block_options, in_sequential=False)
    for block in singles:
        _give_checkpointed_forward(block, block_options, in_sequential=False)
    return model


def _give_checkpointed_forward(
    block: nn.Module, options: Options, in_sequential: bool
) -> None:
    block.forward = CheckpointedForward._with_options(block, options, in_sequential)
    if not isinstance(block, torch.jit.ScriptModule):
        # torch.jit.script asks this first (and would fail obscurely on the
        # forward above); a scripted block is compiled already. A block of a
        # swapped stack is scripted without it (CheckpointedSequential scripts
        # to its plain forward); one of a looped-over list is refused.
        prepare: Callable[[], Any] = (
            functools.partial(without_own_forward, block)
            if in_sequential
            else functools.partial(_not_scriptable, type(block).__name__)
        )
        block.__prepare_scriptable__ = prepare  # type: ignore[assignment]
        # DataParallel's replicas copy the block's attributes: each must get a
        # forward that runs the replica, not the block
        block._replicate_for_data_parallel = functools.partial(  # type: ignore[method-assign]
            _replicate, block
        )


def _run_by_its_stack(block: nn.Module) -> bool:
    """Whether a block of a swapped stack runs inside its CheckpointedSequential
    (which checkpoints it in its segments, or runs it plainly in its last one)
    or inside any region: it is then not a region of its own. Under
    torch.compile (where that cannot be read) always."""
    return (
        torch.compiler.is_compiling()
        or called_by_its_stack(block)
        or is_checkpointing()
        or is_recomputing()
    )


def _replicate(block: nn.Module) -> nn.Module:
    """``block``'s replica for ``nn.DataParallel`` (as ``nn.Module`` makes
    it), with a :class:`CheckpointedForward` of its own."""
    replica: nn.Module = nn.Module._replicate_for_data_parallel(block)  # type: ignore[no-untyped-call]
    own = block.__dict__["forward"]
    replica.__dict__["forward"] = CheckpointedForward._with_options(
        replica, own.options, own.in_sequential
    )
    replica.__dict__["_replicate_for_data_parallel"] = functools.partial(
        _replicate, replica
    )
    return replica


_OPTION_NAMES = frozenset(inspect.signature(make_options).parameters)


def _checked_options(options: dict[str, Any], who: str) -> Options:
    unknown = sorted(set(options) - _OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"seqckpt: {who} got unknown option(s) {', '.join(unknown)}; it takes "
            f"seqckpt.checkpoint's keywords: {', '.join(sorted(_OPTION_NAMES))}."
        )
    return make_options(**options)


def without_own_forward(block: nn.Module) -> nn.Module:
    """``block`` with its class's forward again (a CheckpointedForward or a
    seqckpt.KeptForward taken off), for torch.jit.script (which puts what this
    returns in the block's place, in the Python model too): a stack keeps
    checkpointing its segments, a loop over it no longer does."""
    for name in ("forward", "__prepare_scriptable__", "_replicate_for_data_parallel"):
        block.__dict__.pop(name, None)
    return block


def _not_scriptable(name: str) -> None:
    raise TypeError(
        f"seqckpt: torch.jit.script cannot compile {name}: checkpoint_blocks gave "
        "it a checkpointed forward (a Python object). Script the blocks before "
        "calling checkpoint_blocks (scripted blocks are checkpointed too), script "
        "a model without checkpointing, or use torch.compile."
    )


def _checkpoints_itself(module: nn.Module) -> bool:
    """A module whose own code checkpoints its blocks: HF transformers' and
    diffusers' with ``gradient_checkpointing`` set, a timm model with
    ``grad_checkpointing``."""
    return any(
        module.__dict__.get(flag) is True
        for flag in ("gradient_checkpointing", "grad_checkpointing")
    )


def _plain_layer(module: object) -> bool:
    """A single layer without parameters (an activation, a pooling or dropout
    layer): in a swapped stack it joins the region of the block before it,
    which keeps one tensor less than a region of its own would (torchvision's
    squeezenet1_0 at 128x128, batch 2: 11.64 -> 9.23 MiB)."""
    return (
        isinstance(module, nn.Module)
        and not module._modules
        and next(module.parameters(), None) is None
    )


def _is_block(module: nn.Module | None) -> TypeGuard[nn.Module]:
    """A module holding submodules: a block, not a single layer."""
    return module is not None and bool(module._modules)


# The containers a stack (and a stage of stacks) is held in, their subclasses
# too (torchvision's RegNet stages and DenseNet blocks, timm's DenseNet blocks)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_stack(module: nn.Module, name: str = "") -> bool:
    """A container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict`` or
    a subclass) of two or more modules of one class, or of two or more blocks
    (modules holding submodules) of several classes: a hybrid stack (Jamba's
    Mamba and attention layers, MobileNetV2's ``features``). An
    ``nn.ModuleDict`` holds blocks only (a dict of single layers is a set of
    heads or adapters, not a chain).
    Not a list of modules run side by side (a list or dict whose name,
    ``name`` being where its parent holds it, says so: routed ``experts``,
    ``local_experts`` as mixture-of-experts layers name them, of which a
    token goes to a few; parallel ``paths`` of one input, as SKNet's
    selective kernels): the layer holding them is the block. (HRNet's
    ``branches`` stay a stack: taking each branch whole as a region keeps
    fewer tensors there than a region per block.)"""
    if not isinstance(module, _CONTAINERS):
        return False
    members = list(module._modules.values())  # a shared block as often as it is there
    if len(members) < 2 or any(m is None for m in members):
        return False
    if not isinstance(module, nn.Sequential) and _side_by_side(name):
        return False
    if len({type(m) for m in members}) == 1 and not isinstance(module, nn.ModuleDict):
        return True
    return all(map(_is_block, members))


# Words in the name of a list or dict of modules that run side by side
_SIDE_BY_SIDE = ("expert", "path")


def _side_by_side(name: str) -> bool:
    """Whether a container held under ``name`` holds modules run side by
    side (routed ``experts``, parallel ``paths``), not one after another."""
    return any(word in name.rpartition(".")[2].lower() for word in _SIDE_BY_SIDE)


def _holds_one_block(module: nn.Module, name: str = "") -> bool:
    """An ``nn.Sequential`` or ``nn.ModuleList`` (or a subclass) holding one
    block of two weight layers or more: a stack of blocks built one deep (an
    HF model with ``num_hidden_layers=1``, a diffusers transformer with one
    double-stream block beside its single-stream ones), taken where nothing
    encloses it and nothing is inside, unless ``segments`` is given. A list of
    one downsampling convolution (diffusers' ``downsamplers``) is a layer."""
    members = list(module._modules.values())
    return (
        isinstance(module, (nn.Sequential, nn.ModuleList))
        and len(members) == 1
        and _sizable_block(members[0])
        and not _side_by_side(name)
    )


def _sizable_block(module: nn.Module | None) -> bool:
    """A block (not a container) of two weight layers or more: what a lone
    list member or a numbered attribute must be to count as a block of a
    stack; a stem's ``conv1`` (a convolution and its norm) is a layer."""
    return (
        _is_block(module)
        and not isinstance(module, _CONTAINERS)
        and _weight_layers(module) >= 2
    )


def _blocks_between_layers(module: nn.Module) -> bool:
    """An ``nn.Sequential`` or ``nn.ModuleList`` (or a subclass: torchvision's
    detection heads, timm's stems) of two or more blocks with single layers
    between them, as many blocks as layers or more: a trunk (SqueezeNet's
    fire modules between pooling layers, DPN's blocks). Taken where no stack
    encloses it and it holds none: inside a block such a list is the block's
    own layers (MobileNetV2's convolutions and norms)."""
    if not isinstance(module, (nn.Sequential, nn.ModuleList)):
        return False
    members = list(module._modules.values())
    blocks = sum(map(_is_block, members))
    return blocks >= 2 and 2 * blocks >= len(members) and None not in members


def _numbered_blocks(module: nn.Module, least: int = 2) -> bool:
    """A module (no container) holding as its attributes only ``least`` or
    more blocks of one class, named as numbered (``b1``, ``b2``, ...), and no
    parameter of its own: timm's RegNet stages, which loop over
    ``self.children()``: a stage (see :func:`_is_stage`), whose blocks are
    taken one by one (:func:`_numbered_children`), whatever their size."""
    members = list(module._modules.values())
    if (
        isinstance(module, _CONTAINERS)
        or len(members) < least
        or next(module.parameters(recurse=False), None) is not None
    ):
        return False
    kind = type(members[0])
    if issubclass(kind, _CONTAINERS) or not _is_block(members[0]):
        return False
    if any(type(m) is not kind for m in members):
        return False
    names = [_NUMBERED.fullmatch(n) for n in module._modules]
    if not all(names):
        return False
    prefixes = {m.group(1) for m in names if m is not None}
    numbers = sorted(int(m.group(2)) for m in names if m is not None)
    return len(prefixes) == 1 and numbers == list(
        range(numbers[0], numbers[0] + len(numbers))
    )


def _numbered_children(module: nn.Module) -> set[str]:
    """The names of the blocks ``module`` holds as numbered attributes, two
    or more of one class under one name: ``inception3a`` to ``inception5b``
    (GoogLeNet), ``Mixed_5b`` ... (InceptionV3, a group per block class),
    ``tree1``, ``tree2`` (DLA), or, where ``module`` holds nothing else,
    ``b1``, ``b2``, ... (timm's RegNet stages, which loop over
    ``self.children()``). Beside other attributes a block needs two weight
    layers or more: a stem's ``conv1``, ``conv2`` (a convolution and its norm
    each) and a ``bn1``, ``bn2`` with an activation inside are a module's own
    layers."""
    if _numbered_blocks(module):
        return set(module._modules)
    if isinstance(module, _CONTAINERS):
        return set()
    groups: dict[tuple[type, str], list[str]] = {}
    for name, m in module._modules.items():
        found = _NUMBERED.fullmatch(name)
        if found and _sizable_block(m):
            groups.setdefault((type(m), found.group(1)), []).append(name)
    return {name for names in groups.values() if len(names) >= 2 for name in names}


def _holds_no_numbered(module: nn.Module, bodies: AbstractSet[int]) -> bool:
    """A numbered block that holds no stack of blocks and no numbered blocks
    of its own and is no stage (timm's RegNet stages hold ``b1``, ``b2``,
    ...; DLA's trees hold trees): taking it nests no checkpoint, and no
    smaller blocks are there to take instead (those are taken, at the next
    level down; a stage's one block as a lone block)."""
    return (
        _nothing_inside(module, bodies)
        and not _numbered_children(module)
        and not _is_stage(module)
    )


# a name, a number and at most one letter: b1, layer4, inception3a, Mixed_5b
_NUMBERED = re.compile(r"([A-Za-z_]+?)_?(\d+)[a-z]?")


def _swappable(stack: nn.Module) -> bool:
    """A stack called as a whole, by ``nn.Sequential``'s own forward: it is
    swapped for a CheckpointedSequential. Any other (a list or dict, a
    container subclass with a forward or attributes of its own) keeps its
    place, and its blocks are made regions one by one."""
    return type(stack) is nn.Sequential


def _checkpointed(module: nn.Module) -> bool:
    """Swapped or given a checkpointed forward (by an earlier call)."""
    return isinstance(module, CheckpointedSequential) or isinstance(
        module.__dict__.get("forward"), CheckpointedForward
    )


def _holds_blocks(module: nn.Module, name: str = "") -> bool:
    """A stack whose modules hold submodules: blocks, not single layers."""
    blocks = module._modules.values()
    return _is_stack(module, name) and any(map(_is_block, blocks))


def _holds_stages(module: nn.Module) -> bool:
    """A container of two or more stages, stages all (timm's EfficientNet,
    MobileNetV3 and GhostNet ``blocks``, its ByobNet ``stages``), or a module
    holding two or more stages as numbered attributes of one name
    (torchvision's and timm's ResNet: ``layer1`` to ``layer4``; timm's RegNet:
    ``s1`` to ``s4``)."""
    members = module._modules
    if isinstance(module, _CONTAINERS):
        return len(members) >= 2 and all(map(_is_stage, members.values()))
    prefixes = [
        found.group(1)
        for name, m in members.items()
        if _is_stage(m) and (found := _NUMBERED.fullmatch(name))
    ]
    return len(prefixes) > len(set(prefixes))


def _is_stage(module: nn.Module | None) -> bool:
    """A container, or a module holding its blocks as numbered attributes."""
    return isinstance(module, _CONTAINERS) or (
        module is not None and _numbered_blocks(module, least=1)
    )


def _is_lone_block(module: nn.Module, bodies: AbstractSet[int]) -> bool:
    """A stage of one block (no stack, being one module), taken beside the
    stages of several that are: the first stages of EfficientNet-style
    models hold one block at the largest resolution."""
    return _one_block(module) and _nothing_inside(module, bodies)


def _one_block(module: nn.Module) -> bool:
    """A stage of one block (a module with submodules, not a container: a
    stage holding a stack is the stack's)."""
    blocks = list(module._modules.values())
    return (
        _is_stage(module)
        and len(blocks) == 1
        and _is_block(blocks[0])
        and not isinstance(blocks[0], _CONTAINERS)
    )


def _block_bodies(model: nn.Module) -> set[int]:
    """The ids of the stacks in ``model`` that are a block's own layers:

    - a stack holding no stack of blocks, inside a block of a stack that is
      itself inside a block of a stack (HF's ResNet: stages, each a stack of
      bottleneck blocks, each running its convolution layers as a stack;
      FocalNet's focal layers, HGNetV2's layers). The middle stack is the
      stack of blocks there: a region per few convolutions of a block leaves
      the rest of the block's activations (its residual path) kept.
    - the stacks inside fewer than half the blocks of a stack of blocks
      (Xception's last block runs its convolutions as a stack, its twelve
      others as layers and activations): the outer stack is the stack of
      blocks there. Not for a stack of stages (containers), whose stages of
      one block hold no stack.
    - a stack of blocks with three weight layers or fewer in all, held by a
      block or among the single layers of a trunk: a block's few
      convolutions (the two-convolution branches of an Inception block, S3D's
      separable convolutions), not a stack of blocks of its own (the
      smallest of those, two residual blocks, hold four). Where nothing
      enclosing it is taken, it still is.
    """
    bodies: set[int] = set()

    def walk(module: nn.Module, name: str, enclosing: int, stage: bool) -> bool:
        # (a stage of one block among stages counts as a stack of blocks)
        stack = _holds_blocks(module, name) or (stage and _one_block(module))
        stages = _holds_stages(module)
        holding = []  # the children with a stack of blocks inside (or one)
        for child_name, child in module.named_children():
            if walk(child, child_name, enclosing + stack, stages):
                holding.append(child)
        members = module._modules.values()
        if (
            stack
            and 2 * len(holding) < len(members)
            and not any(isinstance(m, _CONTAINERS) for m in members)
        ):
            bodies.update(
                id(m)
                for block in holding
                for n, m in block.named_modules()
                if _holds_blocks(m, n)
            )
            holding = []
        if stack and not holding and enclosing >= 2:
            bodies.add(id(module))
        return stack or bool(holding)

    walk(model, "", 0, False)
    for parent in model.modules():
        members = parent._modules.values()
        if isinstance(parent, _CONTAINERS) and all(map(_is_block, members)):
            continue  # a stack of stacks: ConvNeXt's stages, however small
        for name, small in parent.named_children():
            if _holds_blocks(small, name) and _weight_layers(small) <= 3:
                bodies.update(map(id, small.modules()))  # with the stacks inside
    return bodies


def _weight_layers(module: nn.Module) -> int:
    """How many modules in ``module`` hold a weight matrix (a parameter of two
    or more dimensions, or one not initialized yet): its convolutions, linear
    layers and embeddings, not its norms."""
    return sum(
        any(
            isinstance(p, nn.parameter.UninitializedParameter) or p.dim() >= 2
            for p in m._parameters.values()
            if p is not None
        )
        for m in module.modules()
    )


def _is_innermost_stack(
    module: nn.Module,
    name: str = "",
    bodies: AbstractSet[int] = frozenset(),
) -> bool:
    """A stack holding no other stack of blocks and nothing checkpointed
    already (checkpoints do not nest, also over two calls). A stack of layers
    without submodules inside a block (Res2Net's ``convs``, CoaT's
    ``conv_list``: a few convolutions of a block, not a stack of blocks) and a
    stack among ``bodies`` (see :func:`_block_bodies`) do not stop the blocks
    from being the stack."""
    return _is_stack(module, name) and _nothing_inside(module, bodies)


def _nothing_inside(module: nn.Module, bodies: AbstractSet[int]) -> bool:
    """No stack of blocks (other than ``bodies``) and nothing checkpointed
    already lies inside ``module``: taking it nests no checkpoint."""
    return not any(
        (_holds_blocks(m, n) and id(m) not in bodies) or _checkpointed(m)
        for n, m in module.named_modules()
        if m is not module
    )
