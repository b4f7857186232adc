"""seqckpt.validate and the `python -m seqckpt` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import seqckpt
from seqckpt.__main__ import main


def test_validate_rows_on_cpu() -> None:
    rows = seqckpt.validate("all", device="cpu")
    assert [r["model"] for r in rows] == ["mlp", "resnet", "transformer", "gpt"]
    for row in rows:
        assert row["bitwise_equal"] and row["ok"], row
        assert row["max_abs_grad_diff"] == 0.0
        assert row["peak_mib_checkpointed"] < row["peak_mib_plain"]
        assert row["reduction_pct"] > 0
        assert row["time_ratio"] > 0


def test_validate_detects_differing_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: break the checkpointed run's dropout replay."""
    import seqckpt.validation as v

    real = v.checkpoint_sequential

    def no_rng(m, k, x, **options):  # type: ignore[no-untyped-def]
        return real(m, k, x, preserve_rng_state=False, **options)

    monkeypatch.setattr(v, "checkpoint_sequential", no_rng)
    (row,) = seqckpt.validate("mlp", device="cpu")
    assert not row["ok"] and not row["bitwise_equal"]
    assert "gradients differ" in row["reason"]


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--model", "mlp", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["model"] == "mlp" and rows[0]["ok"]


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["validate", "--model", "vgg"], "unknown --model 'vgg'"),
        (["validate", "--segments", "0"], "--segments must be between 1 and"),
        (["validate", "--segments", "99"], "got 99"),
        (["validate", "--batch", "0"], "--batch must be at least 1"),
        (["validate", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["validate", "--nope"], "unrecognized arguments: --nope"),
        (["validate", "--policy", "cheap"], "invalid choice: 'cheap'"),
    ],
)
def test_cli_bad_arguments(
    argv: list[str], pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        code = main(argv)
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("seqckpt: ") and pattern in err[-1]
    assert not any("Traceback" in line for line in err)


def test_cli_cuda_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["validate", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_python_dash_m_default_run() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "seqckpt"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "bitwise equal" in done.stdout and "OK" in done.stdout
    assert "validating" in done.stderr
    # A fresh install has no NumPy; torch's warning about it must not show.
    assert "NumPy" not in done.stderr and "Warning" not in done.stderr, done.stderr


def test_import_prints_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import seqckpt"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_quickstart_example_prints_equal_gradients_and_a_lower_peak(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import runpy

    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "quickstart.py"))
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first == "gradients bitwise equal: True"
    assert second.startswith("validate: bitwise equal True, peak ")
    plain, checkpointed = (
        float(v) for v in second.split("peak ")[1][:-4].split(" -> ")
    )
    assert checkpointed < plain


@pytest.mark.cuda
def test_validate_on_cuda() -> None:
    rows = seqckpt.validate("all", device="cuda")
    assert all(r["ok"] for r in rows), rows


def test_grads_close_uses_the_plain_vs_plain_floor() -> None:
    """Without deterministic kernels a gradient passes within allclose or within
    NOISE_FACTOR times the plain-vs-plain difference of the same tensor; a zero
    floor or a difference far above it fails."""
    from seqckpt.validation import NOISE_FACTOR, grads_close

    g = torch.linspace(-1.0, 1.0, 64)
    noise = torch.zeros(64)
    noise[3] = 1e-3  # far outside allclose(rtol=1e-4, atol=1e-6) near zero
    assert not grads_close([(g, g + noise)], [(g, g.clone())])
    assert grads_close([(g, g + noise)], [(g, g + noise / 2)])
    assert grads_close([(g, g + noise)], [(g, g + noise / (NOISE_FACTOR / 2))])
    assert not grads_close([(g, g + noise)], [(g, g + noise / (2 * NOISE_FACTOR))])
    # tensor by tensor: another tensor's large floor does not excuse this one
    h = torch.ones(8)
    assert not grads_close(
        [(g, g + noise), (h, h + 1)], [(g, g + noise), (h, h.clone())]
    )


def test_validate_compares_buffers_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail on buffers alone: unprotected BatchNorm statistics are
    updated twice while the gradients stay equal."""
    from seqckpt._buffers import BufferGuard

    monkeypatch.setattr(BufferGuard, "of", staticmethod(lambda *a, **k: None))
    (row,) = seqckpt.validate("resnet", device="cpu")
    assert not row["ok"] and "buffers differ" in row["reason"]
    assert row["max_abs_grad_diff"] == 0.0


def test_cli_deterministic_sets_cublas_before_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = (
        "import os, torch, json\n"
        "from seqckpt.__main__ import main\n"
        "code = main(['validate', '--model', 'mlp', '--deterministic', '--json'])\n"
        "print(json.dumps([code, os.environ.get('CUBLAS_WORKSPACE_CONFIG'),"
        " torch.are_deterministic_algorithms_enabled()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    *rows_text, last = done.stdout.strip().splitlines()
    rows = json.loads("\n".join(rows_text))
    assert json.loads(last) == [0, ":4096:8", True]
    assert rows[0]["bitwise_equal"] and rows[0]["plain_vs_plain_max_abs_grad_diff"] == 0


def _token_chain() -> nn.Sequential:
    """Token ids in, dropout inside: ten layers."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.GELU()) for _ in range(8)
    ]
    return nn.Sequential(nn.Embedding(40, 16), *blocks, nn.Linear(16, 40))


def test_validate_takes_your_chain_and_leaves_it_as_it_was() -> None:
    chain = _token_chain()
    before = [p.detach().clone() for p in chain.parameters()]
    ids = torch.randint(0, 40, (64, 32))
    (row,) = seqckpt.validate(chain, sample=ids)
    assert row["bitwise_equal"] and row["ok"], row
    # ten layers: round(sqrt(10)) segments; where the sample is; its batch
    assert (row["model"], row["segments"], row["device"], row["batch"]) == (
        "Sequential",
        3,
        "cpu",
        64,
    )
    assert row["peak_mib_checkpointed"] < row["peak_mib_plain"]
    # the chain validated was a copy: no gradients, the same weights
    assert all(p.grad is None for p in chain.parameters())
    assert all(
        torch.equal(p, q) for p, q in zip(chain.parameters(), before, strict=True)
    )
    # a ModuleList, and a segment count of your choice
    (row,) = seqckpt.validate(nn.ModuleList(chain), sample=ids, segments=2)
    assert row["model"] == "ModuleList" and row["segments"] == 2 and row["ok"], row


class _CountsItsCalls(nn.Module):
    """Scales by how often it ran: its recompute differs from its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x * self.calls).sin()  # sin keeps the scaled input for backward


def test_validate_reports_your_chain_that_recomputes_differently() -> None:
    # (in the first of two segments: the last one runs plainly)
    chain = nn.Sequential(nn.Linear(8, 8), _CountsItsCalls(), *[nn.Linear(8, 8)] * 2)
    (row,) = seqckpt.validate(chain, sample=torch.randn(4, 8), segments=2)
    assert not row["ok"] and not row["bitwise_equal"]
    assert "gradients differ" in row["reason"] and row["max_abs_grad_diff"] > 0


@pytest.mark.parametrize(("width", "batch", "hint"), [(512, 1, True), (8, 4096, False)])
def test_validate_says_when_gradients_hide_what_checkpointing_drops(
    width: int, batch: int, hint: bool
) -> None:
    # One segment: nothing is recomputed, so the peak cannot drop. Where the
    # gradients make most of the step's peak the reason says so.
    chain = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    (row,) = seqckpt.validate(chain, sample=torch.randn(batch, width), segments=1)
    assert not row["ok"] and row["reason"].startswith("peak memory did not drop")
    assert ("the parameters' gradients" in row["reason"]) == hint, row["reason"]


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda c, x: seqckpt.validate(c), ValueError, "needs sample="),
        (lambda c, x: seqckpt.validate("mlp", sample=x), ValueError, "sample= is for"),
        (lambda c, x: seqckpt.validate(c, batch=4, sample=x), ValueError, "batch=4"),
        (lambda c, x: seqckpt.validate(c, segments=0, sample=x), ValueError, "got 0"),
        (lambda c, x: seqckpt.validate(3, sample=x), TypeError, "got int"),
        (
            lambda c, x: seqckpt.validate(nn.Sequential(_Argmax()), sample=x),
            TypeError,
            "Sequential returned Tensor holding none that requires grad",
        ),
        # a whole model: its blocks are checkpointed, so it needs some
        (lambda c, x: seqckpt.validate(c[0], sample=x), ValueError, "no stack"),
        (lambda c, x: seqckpt.validate(_Blocks().eval(), sample=x), ValueError, "eval"),
        (lambda c, x: seqckpt.validate(_Blocks()), ValueError, "tuple of arguments"),
        (
            lambda c, x: seqckpt.validate(c, sample=x, policy="cheap"),
            ValueError,
            "argument 'policy' must be",
        ),
    ],
)
def test_validate_your_model_errors(call, error, pattern) -> None:  # type: ignore[no-untyped-def]
    chain = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    with pytest.raises(error, match=pattern) as info:
        call(chain, torch.randn(2, 8))
    assert str(info.value).startswith("seqckpt: ")


class _Argmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)


class _Blocks(nn.Module):
    """A whole model: an input layer, a ModuleList of blocks with dropout and
    batch norm looped over with a keyword, a head returning a dict."""

    def __init__(self, inner: type[nn.Module] = nn.Tanh) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(), inner())
            for _ in range(4)
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) * scale
        return {"logits": self.head(x), "features": x}


def test_validate_takes_your_whole_model_and_leaves_it_as_it_was() -> None:
    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(64, 8)
    # a dict: keywords (as HF models take a batch); a tuple: positional arguments
    (row,) = seqckpt.validate(model, sample={"x": x, "scale": 0.5})
    assert row["bitwise_equal"] and row["ok"], row
    assert (row["model"], row["segments"], row["blocks"], row["batch"]) == (
        "_Blocks",
        None,
        4,
        64,
    )
    assert row["peak_mib_checkpointed"] < row["peak_mib_plain"]
    x.requires_grad_()  # (input gradients are computed, not compared)
    (row,) = seqckpt.validate(model, sample=(x, 2.0))
    assert row["bitwise_equal"] and row["ok"], row
    assert x.grad is None  # the batch is left as it was too
    # validated on copies: no gradients, statistics as they were, no
    # checkpointed forward set on the blocks
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.blocks[0][1].running_mean, torch.zeros(16))
    assert not any("forward" in m.__dict__ for m in model.modules())


class _ScaledList(nn.ModuleList):
    """A ModuleList with a forward of its own: a model, not a chain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x) * 0.5
        return x


@pytest.mark.parametrize("whole", [False, True])
def test_validate_passes_a_policy_to_every_region(whole: bool) -> None:
    torch.manual_seed(0)
    model: nn.Module = _Blocks() if whole else _token_chain()
    sample = torch.randn(256, 8) if whole else torch.randint(0, 40, (64, 32))
    (without,) = seqckpt.validate(model, sample=sample)
    (kept,) = seqckpt.validate(model, sample=sample, policy="compute_heavy")
    assert kept["bitwise_equal"] and kept["ok"], kept
    assert (without["policy"], kept["policy"]) == (None, "compute_heavy")
    # the regions kept their linear layers' outputs: more memory than none
    assert kept["peak_mib_checkpointed"] > without["peak_mib_checkpointed"]


def test_validate_runs_a_container_with_its_own_forward_as_a_model() -> None:
    torch.manual_seed(0)
    blocks = _ScaledList(
        nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8)) for _ in range(3)
    )
    (row,) = seqckpt.validate(blocks, sample=torch.randn(64, 8))
    assert row["ok"] and (row["segments"], row["blocks"]) == (None, 3), row
    # a CheckpointedSequential is a chain: its plain run is its layers', not
    # its own checkpointed forward
    chain = seqckpt.CheckpointedSequential(*blocks, segments=2)
    (row,) = seqckpt.validate(chain, sample=torch.randn(64, 8))
    assert row["ok"] and (row["segments"], row["blocks"]) == (2, 3), row


def test_validate_takes_a_compiled_model() -> None:
    torch.manual_seed(0)
    compiled = torch.compile(_ScaledList(nn.Linear(8, 8) for _ in range(3)))
    (row,) = seqckpt.validate(compiled, sample=torch.randn(64, 8))
    assert row["bitwise_equal"] and row["blocks"] == 3, row
    assert row["model"] == "_ScaledList (compiled)"


def test_validate_passes_on_what_checkpoint_blocks_warns_once() -> None:
    model = _Blocks()
    model.grad_checkpointing = True  # as timm's own switch sets it (unused here)
    with pytest.warns(UserWarning, match="has its own checkpointing on") as said:
        (row,) = seqckpt.validate(model, sample=torch.randn(64, 8))
    assert row["ok"], row
    assert sum("own checkpointing" in str(w.message) for w in said) == 1


def test_validate_reports_your_whole_model_that_recomputes_differently() -> None:
    (row,) = seqckpt.validate(_Blocks(_CountsItsCalls), sample=torch.randn(4, 8))
    assert not row["ok"] and "gradients differ" in row["reason"], row


_CHAIN_MODULE = """
import torch
from torch import nn

def make():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(*blocks), torch.randn(16, 8)

def not_a_pair():
    return 3

def not_a_chain():
    return nn.Linear(8, 8), torch.randn(2, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))
            for _ in range(3)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

def make_model():
    torch.manual_seed(0)
    return Net(), torch.randn(64, 8)
"""


@pytest.fixture
def chain_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of the user's, importable, defining ``make()``."""
    name = "seqckpt_test_user_chain"
    (tmp_path / f"{name}.py").write_text(_CHAIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_cli_takes_your_chain_as_module_function(
    chain_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"{chain_module}:make"
    assert main(["validate", "--model", spec, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["model"] == spec and row["segments"] == 2 and row["ok"], row
    assert main(["profile", "--model", spec]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + 4
    assert main(["plan", "--model", spec, "--policies", "none"]) == 0
    assert capsys.readouterr().out.startswith("Plan for layers 0-3")
    # a whole model: validate only (profile and plan take chains)
    spec = f"{chain_module}:make_model"
    assert main(["validate", "--model", spec, "--policy", "compute_heavy"]) == 0
    assert "each of 3 blocks, compute_heavy" in capsys.readouterr().out
    assert main(["profile", "--model", spec]) == 2
    assert "the chain an nn.Sequential or nn.ModuleList; got (Net, Tensor)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("command", ["validate", "profile", "plan"])
@pytest.mark.parametrize(
    ("model", "extra", "pattern"),
    [
        ("{m}:not_a_pair", [], "must return ("),
        ("{m}:not_a_chain", [], "{not_a_chain}"),
        ("{m}:nowhere", [], "has no function 'nowhere'"),
        ("seqckpt_no_such_module:make", [], "cannot import 'seqckpt_no_such_module'"),
        ("{m}:make", ["--batch", "4"], "Leave --batch out"),
    ],
)
def test_cli_your_chain_errors_are_one_line(
    chain_module: str,
    command: str,
    model: str,
    extra: list[str],
    pattern: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [command, "--model", model.format(m=chain_module), *extra]
    assert main(argv) == 2
    # a Linear: no chain for profile and plan, a whole model without blocks
    # for validate
    pattern = pattern.format(
        not_a_chain="finds no stack"
        if command == "validate"
        else "got (Linear, Tensor)"
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("seqckpt: ") and pattern in err[0], err


def test_python_dash_m_imports_your_chain_from_the_current_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "my_chain.py").write_text(_CHAIN_MODULE)
    # seqckpt found as this test found it (installed, or on a relative path)
    here = str(Path(seqckpt.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "seqckpt", "validate", "--model", "my_chain:make"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr
    assert "my_chain:make" in done.stdout and "OK" in done.stdout
