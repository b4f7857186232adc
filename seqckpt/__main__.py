"""Command line: ``python -m seqckpt [validate] [options]``.

With no arguments it validates the default model on CUDA when available, else on
the CPU. Bad arguments give one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from seqckpt.models import MODELS
from seqckpt.validation import validate

DEFAULT_MODEL = "resnet"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"seqckpt: {message} (see python -m seqckpt --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m seqckpt",
        description="Show that checkpointing keeps gradients and lowers peak memory.",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    v = sub.add_parser("validate", help="plain vs checkpointed step on embedded models")
    v.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"one of {', '.join(MODELS)}, or all (default {DEFAULT_MODEL})",
    )
    v.add_argument("--device", choices=["cpu", "cuda"], default=None)
    v.add_argument("--segments", type=int, default=None, help="segment count")
    v.add_argument("--batch", type=int, default=None, help="batch size")
    v.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "model", "device", "segments", "peak MiB plain", "peak MiB ckpt",
        "reduction %", "time x plain", "max |grad diff|", "bitwise equal",
    )  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            (
                r["model"],
                r["device"],
                str(r["segments"]),
                f"{r['peak_mib_plain']:.2f}",
                f"{r['peak_mib_checkpointed']:.2f}",
                f"{r['reduction_pct']:.1f}",
                f"{r['time_ratio']:.2f}",
                f"{r['max_abs_grad_diff']:.3g}",
                "yes" if r["bitwise_equal"] else "no",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False))
        for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:  # bare `python -m seqckpt`
        args = build_parser().parse_args(["validate", *(argv or [])])
    try:
        rows = validate(
            args.model, args.device, args.segments, args.batch, progress=not args.json
        )
    except ValueError as error:
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
