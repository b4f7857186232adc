"""JIT-friendliness: torch.compile(fullgraph=True), TorchScript children and
torch.export. Compiling takes tens of seconds on 2 cores, so these are few."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import seqckpt
from seqckpt import CheckpointedSequential, checkpoint_sequential
from seqckpt.planner.planning import AUTO_STATS
from tests.oracle import assert_matches_plain


def tanh_chain(n: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(n)]
    )


def recording_backend(
    graphs: dict[str, list[torch.fx.GraphModule]], partitioned: bool = False
) -> Any:
    """An AOTAutograd backend that keeps the forward and backward graphs.
    ``partitioned``: split them as torch's own backends do (min-cut, input
    mutations kept in the graph); AOTAutograd's default split fails with "a
    variable needed for gradient computation has been modified by an inplace
    operation" on checkpointed BatchNorm layers, torch's checkpoint too."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def keep(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            graphs[kind].append(gm)
            return gm.forward

        return compiler

    if not partitioned:
        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    return aot_autograd(
        fw_compiler=keep("forward"),
        bw_compiler=keep("backward"),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )


def count(gm: torch.fx.GraphModule, op: Any) -> int:
    return sum(1 for node in gm.graph.nodes if node.target == op)


@pytest.mark.slow
def test_compiled_checkpoint_sequential_recomputes() -> None:
    """fullgraph=True compiles without graph breaks, gradients equal eager, and
    the backward graph recomputes the checkpointed tanh layers instead of keeping
    their outputs (the plain compiled backward contains no forward tanh)."""
    model = tanh_chain()
    x = torch.randn(4, 16, requires_grad=True)
    runs = {}
    for name, fn in {
        "checkpointed": lambda t: checkpoint_sequential(model, 3, t),
        "plain": lambda t: model(t),
    }.items():
        graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend=recording_backend(graphs))
        model.zero_grad()
        x.grad = None
        compiled(x).sum().backward()
        runs[name] = (
            graphs,
            x.grad.clone(),
            [p.grad.clone() for p in model.parameters()],
        )
    model.zero_grad()
    x.grad = None
    checkpoint_sequential(model, 3, x).sum().backward()
    graphs, gx, gp = runs["checkpointed"]
    assert torch.allclose(gx, x.grad, atol=1e-5)
    assert all(
        torch.allclose(a, p.grad, atol=1e-5)
        for a, p in zip(gp, model.parameters(), strict=False)
    )
    tanh = torch.ops.aten.tanh.default
    # segments of sizes 2, 2, 2: tanh layers of the first two are recomputed in
    # backward (a segment's output is the next one's saved input, so the
    # partitioner may keep that one)
    assert count(graphs["backward"][0], tanh) >= 2
    assert count(runs["plain"][0]["backward"][0], tanh) == 0

    # and the compiled forward hands backward fewer tanh outputs than plain
    # (counting every saved tensor would count weights, which torch 2.8's
    # partitioner saves in place of their transposes)
    def saved_tanhs(forward: torch.fx.GraphModule) -> int:
        (outputs,) = forward.graph.find_nodes(op="output")[0].args
        return sum(getattr(o, "target", None) is tanh for o in outputs)

    assert saved_tanhs(graphs["forward"][0]) < saved_tanhs(
        runs["plain"][0]["forward"][0]
    )


@pytest.mark.slow
def test_compiled_policy_keeps_what_eager_keeps() -> None:
    """Under torch.compile a policy becomes torch's selective checkpointing: the
    compiled backward recomputes the tanh layers but not the matmuls the policy
    keeps, and gradients equal eager's."""
    model = tanh_chain()
    x = torch.randn(4, 16, requires_grad=True)
    backward_ops = {}
    for policy in (None, "compute_heavy"):
        graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda t, p=policy: checkpoint_sequential(model, 3, t, policy=p),
            fullgraph=True,
            backend=recording_backend(graphs),
        )
        model.zero_grad()
        x.grad = None
        compiled(x).sum().backward()
        compiled_grads = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
        model.zero_grad()
        x.grad = None
        checkpoint_sequential(model, 3, x, policy=policy).sum().backward()
        eager = [x.grad, *(p.grad for p in model.parameters())]
        assert all(
            torch.allclose(a, b, atol=1e-5)
            for a, b in zip(compiled_grads, eager, strict=True)
        )
        (backward,) = graphs["backward"]
        backward_ops[policy] = (
            count(backward, torch.ops.aten.addmm.default),
            count(backward, torch.ops.aten.tanh.default),
        )
    (addmm_none, tanh_none), (addmm_kept, tanh_kept) = backward_ops.values()
    assert addmm_none >= 2 and addmm_kept == 0  # kept, not recomputed
    assert tanh_kept >= 2  # still recomputed


@pytest.mark.slow
def test_compiled_checkpointed_sequential_module_inductor() -> None:
    model = tanh_chain()
    ckpt = CheckpointedSequential.from_sequential(model, segments=2)
    x = torch.randn(4, 16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(ckpt, fullgraph=True)
    compiled(x).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None
    model(x).sum().backward()
    ref = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, ref, strict=False))


def test_torchscript_children_bitwise() -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.GELU())),
            nn.BatchNorm1d(8),
            torch.jit.script(nn.Linear(8, 8)),
            nn.Tanh(),
            torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2))),
        )

    for k in (1, 2, 3):
        x = torch.randn(5, 8, requires_grad=True)
        assert_matches_plain(make, x, lambda m, x: checkpoint_sequential(m, k, x))


@pytest.mark.parametrize("policy", [None, "compute_heavy"])
def test_deep_copied_torchscript_children(policy: str | None) -> None:
    # copy.deepcopy of a TorchScript module (an EMA or teacher copy) holds its
    # parameters as plain tensors, which were taken for torch.func.functional_call
    # stand-ins: the recompute's replay then failed on TorchScript's parameter
    # mapping ('OrderedDictWrapper' object has no attribute 'get').
    torch.manual_seed(0)
    model = nn.Sequential(
        torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.GELU())),
        nn.Linear(8, 8),
        torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.GELU())),
    )  # (GELU, not Tanh: see the note in tests/test_blocks.py)
    x = torch.randn(4, 8, requires_grad=True)
    assert_matches_plain(  # (the oracle runs deep copies of the model)
        model, x, lambda m, x: checkpoint_sequential(m, 2, x, policy=policy)
    )


def test_torchscript_compiles_the_plain_forward() -> None:
    # As nn.Sequential can be scripted, so can its drop-in: TorchScript cannot
    # checkpoint, so the scripted forward is the plain one; the eager module,
    # also as the child of a scripted parent, keeps checkpointing.
    model = CheckpointedSequential(*tanh_chain(), segments=3)
    parent = nn.Sequential(model, nn.Linear(16, 2))
    scripted = torch.jit.script(parent)
    x = torch.randn(4, 16)
    assert torch.equal(scripted(x), parent(x))
    assert list(scripted.state_dict()) == list(parent.state_dict())
    assert type(parent[0]) is CheckpointedSequential
    assert_matches_plain(
        lambda: CheckpointedSequential(*tanh_chain(), segments=3),
        torch.randn(4, 16, requires_grad=True),
        lambda m, t: m(t),
        plain=lambda m, t: nn.Sequential(*m)(t),
    )


def test_export_in_eval_mode() -> None:
    model = CheckpointedSequential(*tanh_chain(), segments=3).eval()
    x = torch.randn(4, 16)
    exported = torch.export.export(model, (x,))
    assert torch.equal(exported.module()(x), model(x))
    assert list(exported.state_dict) == list(model.state_dict())


class _CheckpointsOneBlock(nn.Module):
    def __init__(self, policy: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 16)
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(seqckpt.checkpoint(self.block, x, policy=self.policy))


@pytest.mark.slow
@pytest.mark.parametrize("strict", [True, False])
def test_export_in_training_mode_records_the_plain_forward(strict: bool) -> None:
    """A model in training mode whose forward checkpoints exports as its plain
    forward, strictly too, where torch 2.13's checkpoint fails (its operator
    reads a context function that only selective checkpointing sets), and
    ``segments="auto"`` exports without profiling (which compiled code cannot)."""
    x = torch.randn(4, 16)
    for policy in (None, "compute_heavy"):
        model = _CheckpointsOneBlock(policy)
        exported = torch.export.export(model, (x,), strict=strict)
        assert torch.equal(exported.module()(x), model(x))
        ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
        assert ops == {"aten.linear.default", "aten.gelu.default"}
    # segments="auto" without an eager step first: nothing to plan or profile
    chain = CheckpointedSequential(*tanh_chain(), segments="auto", memory_budget="1MiB")
    profiles = AUTO_STATS.profiles
    exported = torch.export.export(chain, (x,), strict=strict)
    assert torch.equal(exported.module()(x), nn.Sequential.forward(chain, x))
    assert AUTO_STATS.profiles == profiles


def test_names_and_flags_compile_without_graph_breaks() -> None:
    """seqckpt.name (a no-op there) and is_checkpointing / is_recomputing (False
    there: the compiled graph recomputes without Python) inside a compiled
    function, a checkpointed one and a module hook: dynamo traces them all
    (fullgraph)."""
    import seqckpt

    lin = nn.Sequential(nn.Linear(8, 8))

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        # no side effect: dynamo refuses those inside a checkpoint
        return (
            out + 1 if seqckpt.is_recomputing() or seqckpt.is_checkpointing() else out
        )

    lin[0].register_forward_hook(hook)

    def block(t: torch.Tensor) -> torch.Tensor:
        h = seqckpt.name(lin(t), "h").tanh()
        return h * 2 if seqckpt.is_recomputing() or seqckpt.is_checkpointing() else h

    x = torch.randn(4, 8, requires_grad=True)
    expected = lin(x).tanh()
    keep_h = seqckpt.policies.names("h")  # made outside: dynamo takes it as a constant
    for fn in (block, lambda t: seqckpt.checkpoint(block, t, policy=keep_h)):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), expected)


def test_policies_made_inside_compiled_code() -> None:
    """A list of ops or a callable (also one written for torch's selective
    checkpointing, ctx first) given as policy= inside the compiled function
    (HF passes partial(seqckpt.checkpoint, policy=...) and the policy is made at
    each call): dynamo takes the selective-checkpointing context as a constant."""
    import seqckpt

    model = tanh_chain(2)
    x = torch.randn(4, 16, requires_grad=True)

    def keep_addmm(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is torch.ops.aten.addmm.default

    def torch_keeps_addmm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        if op is torch.ops.aten.addmm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    expected = torch.autograd.grad(model(x).sum(), x)[0]
    for policy in ([torch.ops.aten.addmm], keep_addmm, torch_keeps_addmm):
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda t, p=policy: seqckpt.checkpoint(model, t, policy=p),
            fullgraph=True,
            backend="eager",
        )
        (got,) = torch.autograd.grad(compiled(x).sum(), x)
        assert torch.allclose(got, expected, atol=1e-6)


def test_segments_auto_compiles_after_an_eager_step() -> None:
    """segments='auto' profiles in eager mode; once a step has run there, the
    compiled model (fullgraph) uses the plan chosen for the input."""
    model = CheckpointedSequential(
        *tanh_chain(6), segments="auto", memory_budget="1MiB"
    )
    x = torch.randn(8, 16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(Exception):  # noqa: B017 (dynamo wraps seqckpt's error)
        compiled(x)  # the profile cannot run while dynamo traces
    model(x).sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), model(x))


@pytest.mark.slow
def test_compiled_names_policy_keeps_the_named_tensor() -> None:
    """Under torch.compile a kept name becomes seqckpt::named in the graph,
    saved by torch's selective checkpointing: the compiled backward receives
    the named tensor and does not recompute the matmul that produced it."""
    import seqckpt

    torch.manual_seed(0)
    w1 = torch.randn(16, 16, requires_grad=True)
    w2 = torch.randn(16, 16, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        return (seqckpt.name(t @ w1, "h").tanh() @ w2).sin()

    x = torch.randn(4, 16, requires_grad=True)
    expected = torch.autograd.grad(block(x).sum(), [x, w1, w2])
    keep_h = seqckpt.policies.names("h")
    matmuls = {}
    for policy in (None, keep_h):
        graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda t, p=policy: seqckpt.checkpoint(block, t, policy=p),
            fullgraph=True,
            backend=recording_backend(graphs),
        )
        got = torch.autograd.grad(compiled(x).sum(), [x, w1, w2])
        assert all(
            torch.allclose(a, b, atol=1e-5) for a, b in zip(got, expected, strict=True)
        )
        (backward,) = graphs["backward"]
        matmuls[policy] = count(backward, torch.ops.aten.mm.default)
        # a name some names policy keeps is in the graph, whatever this policy
        assert count(graphs["forward"][0], torch.ops.seqckpt.named.default) == 1
    assert matmuls[keep_h] == matmuls[None] - 1  # t @ w1 is not run again


def test_compiled_checkpoints_do_not_recompile() -> None:
    """Calling a compiled function again with a fresh input of the same shape
    reuses its graph (torch pins the same for its checkpoint): nothing seqckpt
    builds per call (options, policies, the selective context) is guarded on."""
    import seqckpt

    model = tanh_chain(2)
    module = CheckpointedSequential(*tanh_chain(3), segments=2, policy="compute_heavy")
    for fn in (
        lambda t: seqckpt.checkpoint(model, t),
        lambda t: seqckpt.checkpoint(model, t, policy=[torch.ops.aten.addmm]),
        module,
    ):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                compiled(torch.randn(4, 16, requires_grad=True)).sum().backward()


def test_compiled_module_list_blocks_recompute() -> None:
    """A model looping over an nn.ModuleList checkpointed by checkpoint_blocks
    compiles with fullgraph=True, and its compiled backward runs each block's
    inner tanh again (each block's CheckpointedForward becomes torch's
    checkpoint)."""
    import seqckpt

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(
                nn.Sequential(
                    nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh()
                )
                for _ in range(3)
            )  # (blocks, not stacks: a Sequential of two classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    tanhs = {}
    for checkpointed in (False, True):
        model = Loop()
        if checkpointed:
            seqckpt.checkpoint_blocks(model)
        graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        torch._dynamo.reset()
        compiled = torch.compile(
            model, fullgraph=True, backend=recording_backend(graphs)
        )
        x = torch.randn(4, 16, requires_grad=True)
        out = compiled(x)
        out.sum().backward()
        assert torch.allclose(out, Loop()(x))
        tanhs[checkpointed] = count(graphs["backward"][0], torch.ops.aten.tanh.default)
    # each block's inner tanh at least (the partitioner may also recompute the
    # last block's final tanh rather than keep the model's output for it)
    assert tanhs[False] == 0 and tanhs[True] >= 3


@pytest.mark.parametrize("how", ["torch.compile", ".compile()"])
@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"policy": "compute_heavy"}, "runs eagerly"),
        ({"debug": True}, "runs eagerly"),
        ({"determinism_check": "values"}, "graph breaks"),
    ],
)
def test_a_compiled_module_under_a_mode_based_option_warns(
    how: str, options: dict[str, Any], words: str
) -> None:
    # torch.compile does not compile under the dispatch mode a policy or debug
    # needs, and traces "values"' global module hook with graph breaks: the
    # region still gives the gradients of what ran (the eager backend here),
    # but a user compiling for speed must hear that it did not run compiled.
    import seqckpt

    def compiled(m: nn.Module) -> nn.Module:
        if how == "torch.compile":
            return torch.compile(m, backend="eager")  # type: ignore[return-value]
        m.compile(backend="eager")
        return m

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match=rf"^seqckpt: .*compiled with .*{words}"):
        assert_matches_plain(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)),
            x,
            lambda m, t: seqckpt.checkpoint(compiled(m), t, **options),
        )


def test_a_compiled_function_under_a_policy_warns() -> None:
    import seqckpt

    lin = nn.Linear(8, 8)
    f = torch.compile(lambda t: lin(t).tanh(), backend="eager")
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="a function compiled with torch.compile"):
        y = seqckpt.checkpoint(f, x, policy="compute_heavy")
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_a_compiled_module_without_a_policy_does_not_warn() -> None:
    import warnings

    import seqckpt

    block = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), backend="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="seqckpt")
        seqckpt.checkpoint(
            block, torch.randn(2, 8, requires_grad=True)
        ).sum().backward()


def test_a_compiled_module_beside_a_large_buffer_compiles() -> None:
    # A buffer of COPY_LIMIT bytes or more is copied at its first write, seen
    # by a dispatch mode, under which fullgraph=True fails ("found no compiled
    # frames"); where the region runs a compiled module it is copied up front.
    import seqckpt
    from tests.test_checkpoint import CausalScores

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scores = CausalScores()  # a 1 MiB mask
            self.mlp = torch.compile(
                nn.Sequential(nn.Linear(8, 8), nn.GELU()),
                fullgraph=True,
                backend="eager",
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.scores(x))

    def make() -> nn.Module:
        torch.manual_seed(0)
        return Block()

    torch._dynamo.reset()  # (earlier tests' compiles count toward its limits)
    x = torch.randn(2, 16, 8, requires_grad=True)
    assert_matches_plain(make, x, lambda m, t: seqckpt.checkpoint(m, t))


class _Residual(nn.Module):
    """torchvision's BasicBlock in small: its ReLUs in place (seqckpt.models'
    residual block applies torch.relu out of place, so it is not used here)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


def _small_resnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Sequential(_Residual(8), _Residual(8)),  # a stage: the stack taken
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


@pytest.mark.slow
@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.9",
    reason="torch 2.8's compiled checkpoint, which seqckpt hands compiled code "
    "to, updates batch norm's running statistics in the recompute too (twice "
    "the update; also with torch's checkpoint alone); fixed in torch 2.9",
)
def test_compiled_checkpoint_blocks_model_with_batch_norm() -> None:
    """A ResNet-shaped model after checkpoint_blocks (BatchNorm in training
    mode, in-place ReLUs) compiles with fullgraph=True as it is called in
    training scripts, and its gradients and running statistics are bitwise
    those of the same model compiled without checkpointing, while its
    compiled backward runs convolutions of the forward again."""
    import seqckpt

    results, convolutions = [], []
    for checkpointed in (False, True):
        model = _small_resnet().train()
        if checkpointed:
            seqckpt.checkpoint_blocks(model)
            assert isinstance(model[3], CheckpointedSequential)
        graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        torch._dynamo.reset()
        compiled = torch.compile(
            model, fullgraph=True, backend=recording_backend(graphs, partitioned=True)
        )
        torch.manual_seed(1)
        compiled(torch.randn(2, 3, 8, 8)).sum().backward()
        results.append([p.grad for p in model.parameters()] + list(model.buffers()))
        convolutions.append(
            sum(
                count(gm, torch.ops.aten.convolution.default)
                for gm in graphs["backward"]
            )
        )
    for plain, checkpointed in zip(*results, strict=True):
        assert torch.equal(plain, checkpointed)
    assert convolutions[0] == 0 and convolutions[1] >= 4  # the stage's four convs


@pytest.mark.slow
def test_compiled_region_with_a_kept_call() -> None:
    """seqckpt.keep is a plain call in compiled code (fullgraph=True: no graph
    break), where the region becomes torch's checkpoint operator."""
    import seqckpt

    model = tanh_chain(4)

    def block(t: torch.Tensor) -> torch.Tensor:
        return model[3](model[2](seqckpt.keep(model[1], model[0](t))))

    x = torch.randn(4, 16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: seqckpt.checkpoint(block, t), fullgraph=True, backend="aot_eager"
    )
    compiled(x).sum().backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    model.zero_grad()
    x.grad = None
    model(x).sum().backward()
    expected = [x.grad, *(p.grad for p in model.parameters())]
    assert all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True)
    )
