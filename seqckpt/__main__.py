"""Command line: ``python -m seqckpt [validate|profile|plan] [options]``.

With no arguments it validates the default model on CUDA when available, else on
the CPU. ``--model`` names an embedded model, or your own chain as
``module:function``, a function of no arguments that returns ``(chain,
sample_batch)`` (the module imported as ``python -m`` imports, from the current
directory too); ``validate`` also takes a whole model there, its blocks
checkpointed by ``checkpoint_blocks``. ``profile`` prints the per-layer table
the planner uses; ``plan`` prints the plan for a budget with its predicted and
measured peak and time, and with ``--plot`` the memory/time frontier;
``--autocast bf16`` (or ``fp16``) profiles, plans and measures the forward
under ``torch.autocast``, backward after it, as torch's mixed-precision recipe
runs a step. Bad arguments give one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from typing import Any, NoReturn

import torch
from torch import nn

from seqckpt.models import MODELS
from seqckpt.planner import PlanError, parse_budget, plan, profile
from seqckpt.planner.budget import format_bytes
from seqckpt.planner.frontier import (
    format_frontier,
    frontier,
    measure_step,
    plot_frontier,
)
from seqckpt.policies import POLICIES
from seqckpt.validation import (
    batch_of,
    make_deterministic,
    place,
    resolve_device,
    validate,
)

DEFAULT_MODEL = "resnet"
YOUR_CHAIN = "or your own chain as module:function returning (chain, sample_batch)"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"seqckpt: {message} (see python -m seqckpt --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m seqckpt",
        description="Show that checkpointing keeps gradients and lowers peak memory.",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    v = sub.add_parser(
        "validate", help="plain vs checkpointed step on embedded models or yours"
    )
    v.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"one of {', '.join(MODELS)}, or all (default {DEFAULT_MODEL}); "
        "or your own chain or whole model (its blocks checkpointed by "
        "checkpoint_blocks) as module:function returning (model, sample_batch)",
    )
    v.add_argument("--device", choices=["cpu", "cuda"], default=None)
    v.add_argument(
        "--segments",
        type=int,
        default=None,
        help="segment count (a whole model: per nn.Sequential stack; default "
        "every block its own region)",
    )
    v.add_argument(
        "--policy",
        choices=["none", *POLICIES],
        default="none",
        help="what each checkpointed region keeps (default none: its inputs only)",
    )
    v.add_argument("--batch", type=int, default=None, help="batch size")
    v.add_argument("--json", action="store_true", help="print the rows as JSON")
    v.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (cuBLAS workspace set before CUDA starts, "
        "torch.use_deterministic_algorithms): gradients compared bitwise on CUDA",
    )

    for name, text in (
        ("profile", "per-layer time and memory of an embedded model"),
        ("plan", "the fastest plan under a memory budget, predicted and measured"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help=f"one of {', '.join(MODELS)} (default {DEFAULT_MODEL}); " + YOUR_CHAIN,
        )
        p.add_argument("--device", choices=["cpu", "cuda"], default=None)
        p.add_argument("--batch", type=int, default=None, help="batch size")
        p.add_argument(
            "--policies",
            default="none,compute_heavy",
            help="candidate policies of each recomputed stretch, comma-separated "
            "(default none,compute_heavy; 'none' alone: no selective saving)",
        )
        p.add_argument(
            "--autocast",
            choices=list(AUTOCAST_DTYPES),
            default=None,
            help="run each forward under torch.autocast with this dtype (backward "
            "after it, as in torch's mixed-precision recipe)",
        )
        if name == "plan":
            p.add_argument(
                "--budget",
                default=None,
                help="memory budget beyond parameters, grads and input, e.g. 64MiB "
                "(default: none, the fastest plan)",
            )
            p.add_argument(
                "--plot",
                default=None,
                metavar="PNG",
                help="also measure the memory/time frontier and draw it here "
                "(a text table without matplotlib)",
            )
        p.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _segments_column(row: dict[str, Any]) -> str:
    text = (
        str(row["segments"])
        if row["segments"] is not None
        else f"each of {row['blocks']} blocks"
    )
    return text if row["policy"] is None else f"{text}, {row['policy']}"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "model", "device", "segments", "peak MiB plain", "peak MiB ckpt",
        "reduction %", "time x plain", "max |grad diff|", "plain vs plain",
        "bitwise equal",
    )  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            (
                r["model"],
                r["device"],
                _segments_column(r),
                f"{r['peak_mib_plain']:.2f}",
                f"{r['peak_mib_checkpointed']:.2f}",
                f"{r['reduction_pct']:.1f}",
                f"{r['time_ratio']:.2f}",
                f"{r['max_abs_grad_diff']:.3g}",
                f"{r['plain_vs_plain_max_abs_grad_diff']:.3g}",
                "yes" if r["bitwise_equal"] else "no",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False))
        for line in lines
    )


def load_chain(
    args: argparse.Namespace, names: str, whole_models: bool = False
) -> tuple[Any, Any]:
    """``(chain, sample_batch)`` from ``--model module:function``: the module
    imported (``python -m`` imports from the current directory too), the
    function called without arguments; ``names``: the embedded models the
    option also takes, for the error; ``whole_models``: any ``nn.Module`` is
    taken, not only chains (validate). ``--batch`` is refused: the sample
    sets the batch."""
    spec = args.model
    module_name, _, attribute = spec.partition(":")
    where = f"--model {spec!r}"
    if not module_name or not attribute:
        raise ValueError(
            f"seqckpt: unknown {where}; choose one of {names}, or give your own "
            "chain as module:function (e.g. --model mymodels:make_chain)."
        )
    if args.batch is not None:
        raise ValueError(
            f"seqckpt: --batch sizes the embedded models' inputs; {spec}'s sample "
            "sets its batch. Leave --batch out."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"seqckpt: {where}: cannot import {module_name!r} ({error}); run from "
            "the directory that holds it, or put it on PYTHONPATH."
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(
            f"seqckpt: {where}: {module_name} has no function {attribute!r}."
        )
    made = function()
    taken = nn.Module if whole_models else (nn.Sequential, nn.ModuleList)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], taken)):
        got = type(made).__name__
        if isinstance(made, tuple) and len(made) == 2:
            got = f"({type(made[0]).__name__}, {type(made[1]).__name__})"
        kind = (
            "(model, sample_batch), the model an nn.Module"
            if whole_models
            else "(chain, sample_batch), the chain an nn.Sequential or nn.ModuleList"
        )
        raise ValueError(
            f"seqckpt: {where}: {attribute}() must return {kind}; got {got}."
        )
    return made


def _model_and_input(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"seqckpt: --batch must be >= 1, got {args.batch}.")
    if args.model in MODELS:
        device = resolve_device(args.device)
        spec = MODELS[args.model]
        return spec.build().to(device), spec.sample(device, args.batch), device
    chain, sample = load_chain(args, ", ".join(MODELS))
    sample, device = place(sample, args.device, chain)
    return chain.to(device), sample, device


def _policies(text: str) -> list[str | None]:
    chosen: list[str | None] = []
    for word in text.split(","):
        word = word.strip()
        if word in ("none", "None", ""):
            chosen.append(None)
        elif word in POLICIES:
            chosen.append(word)
        else:
            raise ValueError(
                f"seqckpt: --policies takes none and {', '.join(POLICIES)}, "
                f"comma-separated, got {word!r}."
            )
    return chosen


def _autocast_dtype(args: argparse.Namespace) -> torch.dtype | None:
    return None if args.autocast is None else AUTOCAST_DTYPES[args.autocast]


def _forward_context(
    args: argparse.Namespace, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    dtype = _autocast_dtype(args)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def run_profile(args: argparse.Namespace) -> int:
    model, x, device = _model_and_input(args)
    with _forward_context(args, device):
        prof = profile(model, x, policies=_policies(args.policies))
    print(json.dumps(prof.to_dict(), indent=1) if args.json else prof.table())
    return 0


def run_plan(args: argparse.Namespace) -> int:
    model, x, device = _model_and_input(args)
    budget = None if args.budget is None else parse_budget(args.budget, "--budget")
    policies = _policies(args.policies)  # a typo fails before the profile runs
    print(f"seqckpt: profiling {args.model} on {device} ...", file=sys.stderr)
    with _forward_context(args, device):
        prof = profile(model, x, policies=policies)
    try:
        chosen = plan(model, x, budget, profile=prof)
    except PlanError as error:
        raise PlanError(str(error).replace("memory_budget=", "--budget ")) from None
    autocast = _autocast_dtype(args)
    measured = measure_step(model, x, chosen, device, autocast=autocast)
    if args.json:
        report = chosen.to_dict()
        report["measured_peak_bytes"] = measured.peak_bytes
        report["measured_time"] = measured.seconds
        print(json.dumps(report, indent=1))
    else:
        print(chosen)
        print(
            f"predicted: peak {format_bytes(chosen.predicted_peak_bytes or 0)}, "
            f"step {(chosen.predicted_time or 0) * 1e3:.1f} ms (forward + backward)\n"
            f"measured:  peak {format_bytes(measured.peak_bytes)}, "
            f"step {measured.seconds * 1e3:.1f} ms (median of 3)"
        )
    if args.plot:
        points = frontier(
            model,
            x,
            prof,
            device,
            progress=lambda what: print(f"seqckpt: measuring {what}", file=sys.stderr),
            autocast=autocast,
        )
        print(format_frontier(points))
        title = f"{args.model}, batch {batch_of(x)}, {device}"
        if args.autocast:
            title += f", {args.autocast} autocast"
        if plot_frontier(points, args.plot, title):
            print(f"seqckpt: frontier drawn in {args.plot}")
        else:
            print(
                "seqckpt: matplotlib is not installed, so no picture was drawn; "
                "pip install 'seqckpt[plot]' for one.",
                file=sys.stderr,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:  # bare `python -m seqckpt`
        args = build_parser().parse_args(["validate", *(argv or [])])
    if args.command in ("profile", "plan"):
        try:
            return run_profile(args) if args.command == "profile" else run_plan(args)
        except (ValueError, TypeError) as error:  # PlanError is a ValueError
            print(str(error).splitlines()[0], file=sys.stderr)
            return 2
    if args.deterministic:
        make_deterministic()  # before anything starts CUDA
    try:
        model: Any = args.model
        sample = None
        if model not in MODELS and model != "all":
            model, sample = load_chain(
                args, ", ".join([*MODELS, "all"]), whole_models=True
            )
        rows = validate(
            model,
            args.device,
            args.segments,
            args.batch,
            progress=not args.json,
            sample=sample,
            policy=None if args.policy == "none" else args.policy,
        )
        if sample is not None:
            rows[0]["model"] = args.model  # module:function, not the class
    except (ValueError, TypeError) as error:
        print(str(error), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows))
    failed = [r for r in rows if not r["ok"]]
    if failed:
        print(
            "seqckpt: FAILED: "
            + "; ".join(f"{r['model']}: {r['reason']}" for r in failed),
            file=sys.stderr,
        )
        return 1
    if not args.json:
        print("seqckpt: OK: gradients match and peak memory dropped for every model.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
