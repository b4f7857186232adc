"""Turn pytest-benchmark JSON files into the Markdown tables of bench/README.md.

Usage:
    python bench/report.py bench/results/overhead.json [more.json ...]

Prints one table per benchmark group: the median step time of each variant as a
ratio to the plain step and to torch's non-reentrant checkpoint (both measured in
the same run), plus the peak memory recorded in ``extra_info`` when present.
Absolute medians are shown too, but on a shared machine only the ratios carry.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

PLAIN = "plain"
TORCH = "torch_nonreentrant"


def _mib(value: float | None) -> str:
    return "" if value is None else f"{value / 2**20:.2f}"


def group_table(rows: list[dict[str, Any]]) -> str:
    by_variant = {r["extra_info"].get("variant", r["name"]): r for r in rows}
    plain = by_variant.get(PLAIN)
    torch_row = by_variant.get(TORCH)
    has_peak = any("peak_bytes" in r["extra_info"] for r in rows)
    head = "| variant | median ms | x plain | x torch non-reentrant |"
    rule = "|---|---:|---:|---:|"
    if has_peak:
        head += " peak MiB | peak x plain |"
        rule += "---:|---:|"
    lines = [head, rule]
    for variant, row in by_variant.items():
        median = row["stats"]["median"]
        cells = [
            variant,
            f"{median * 1e3:.3f}",
            f"{median / plain['stats']['median']:.2f}" if plain else "",
            f"{median / torch_row['stats']['median']:.2f}" if torch_row else "",
        ]
        if has_peak:
            peak = row["extra_info"].get("peak_bytes")
            base = plain["extra_info"].get("peak_bytes") if plain else None
            cells.append(_mib(peak))
            cells.append(f"{peak / base:.2f}" if peak and base else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(paths: list[Path]) -> str:
    out: list[str] = []
    for path in paths:
        data = json.loads(path.read_text())
        info = data["machine_info"]
        out.append(
            f"Run {data['datetime'][:19]} on {info.get('cpu', {}).get('brand_raw', '?')}"
            f", Python {info.get('python_version')}, from `{path}`."
        )
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for bench in data["benchmarks"]:
            groups[bench["group"] or bench["name"]].append(bench)
        for group, rows in groups.items():
            out.append(f"\n#### {group}\n")
            out.append(group_table(rows))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/report.py RESULT.json [RESULT.json ...]")
    print(report([Path(p) for p in sys.argv[1:]]))
