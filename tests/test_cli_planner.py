"""python -m seqckpt profile / plan: output, one-line errors, the frontier."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from seqckpt.__main__ import main
from seqckpt.models import MODELS


def test_profile_prints_one_row_per_item(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "mlp", "--batch", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "fwd ms" in lines[0] and "saved MiB" in lines[0]
    assert len(lines) == 1 + len(MODELS["mlp"].build())


def test_plan_prints_tree_with_predicted_and_measured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(["plan", "--model", "resnet", "--batch", "2", "--budget", "1.2MiB"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("Plan for layers 0-13 (predicted peak")
    assert "recompute" in out
    assert "predicted: peak" in out and "measured:  peak" in out


def test_plan_under_autocast_profiles_and_measures_under_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The forward of every measured step under bf16 autocast, backward after
    # it: the weight casts autocast caches count, and the plan made for them
    # peaks as predicted.
    for autocast, cast in ((["--autocast", "bf16"], True), ([], False)):
        assert main(["profile", "--model", "gpt", "--batch", "2", *autocast]) == 0
        head, *rows = [
            re.split(r"\s{2,}", line.strip())
            for line in capsys.readouterr().out.strip().splitlines()
        ]
        column = head.index("of which casts MiB")
        assert any(float(row[column]) > 0 for row in rows) == cast
    argv = ["plan", "--model", "gpt", "--batch", "2", "--budget", "6MiB"]
    assert main([*argv, "--autocast", "bf16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ratio = report["measured_peak_bytes"] / report["predicted_peak_bytes"]
    assert 0.98 <= ratio <= 1.01, ratio


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--budget", "1KiB", "--batch", "2"], "--budget 1024 bytes"),
        (["plan", "--budget", "lots"], "--budget='lots' is not a size"),
        (["plan", "--model", "nope"], "unknown --model 'nope'; choose one of mlp"),
        (["profile", "--batch", "0"], "--batch must be >= 1"),
        (["plan", "--policies", "none,heavy"], "--policies takes none and"),
        (["profile", "--policies", "heavy"], "--policies takes none and"),
    ],
)
def test_plan_errors_are_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if not line.startswith("seqckpt: profiling")]
    if "--policies" in message:  # checked before the profile starts
        assert errors == lines
    assert (
        len(errors) == 1 and errors[0].startswith("seqckpt:") and message in errors[0]
    )


def test_plot_without_matplotlib_prints_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    picture = tmp_path / "frontier.png"
    assert main(["plan", "--model", "mlp", "--batch", "8", "--plot", str(picture)]) == 0
    captured = capsys.readouterr()
    assert "schedule" in captured.out and "torch uniform" in captured.out
    assert "planned" in captured.out and "seqckpt uniform" in captured.out
    assert "matplotlib is not installed" in captured.err
    assert not picture.exists()


def test_plot_draws_the_picture_with_matplotlib(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib", reason="the optional 'plot' extra")
    from seqckpt.planner.frontier import FrontierPoint, StepMeasurement, plot_frontier

    points = [
        FrontierPoint(kind, str(i), StepMeasurement(2**20 * (i + 1), 0.01 * (3 - i)))
        for kind in ("planned", "seqckpt uniform", "torch uniform")
        for i in range(3)
    ]
    picture = tmp_path / "frontier.png"
    assert plot_frontier(points, str(picture), "test")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frontier_schedules_are_timed_side_by_side() -> None:
    # Round after round, one step of each schedule, so that the machine's
    # drift while it runs moves every schedule alike; peaks (with a warm-up
    # step each) are measured before any timing.
    from torch import nn

    from seqckpt.planner.frontier import measure_steps

    calls: list[str] = []

    def schedule(name: str):  # type: ignore[no-untyped-def]
        def forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
            calls.append(name)
            return model(x)

        return forward

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    got = measure_steps(
        model, torch.randn(2, 4), [schedule("a"), schedule("b")], "cpu", repeats=3
    )
    assert [m.peak_bytes > 0 and m.seconds > 0 for m in got] == [True, True]
    peaks, timing = calls[:4], calls[4:]
    assert peaks == ["a", "a", "b", "b"]  # warm-up and measured step each
    assert timing == ["a", "b"] * 3
