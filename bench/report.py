"""Turn pytest-benchmark JSON files into the Markdown tables of bench/README.md.

Usage:
    python bench/report.py bench/results/all.json [more.json ...]

Prints one table per benchmark group: the median step time of each variant as a
ratio to the plain step and to torch's non-reentrant checkpoint (both measured in
the same run), plus the peak memory recorded in ``extra_info`` when present.
Absolute medians are shown too, but on a shared machine only the ratios carry.
A file from ``bench/test_planner.py`` gets the frontier table and its targets.
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
    has_paired = any("paired_x_plain" in r["extra_info"] for r in rows)
    head = "| variant | median ms | x plain | x torch non-reentrant |"
    rule = "|---|---:|---:|---:|"
    if has_paired:
        head += " x plain (paired) | x torch (paired) |"
        rule += "---:|---:|"
    if has_peak:
        head += " peak MiB | peak x plain | peak x torch |"
        rule += "---:|---:|---:|"
    lines = [head, rule]
    for variant, row in by_variant.items():
        median = row["stats"]["median"]
        cells = [
            variant,
            f"{median * 1e3:.3f}",
            f"{median / plain['stats']['median']:.2f}" if plain else "",
            f"{median / torch_row['stats']['median']:.2f}" if torch_row else "",
        ]
        if has_paired:
            info = row["extra_info"]
            for key, is_base in (("paired_x_plain", variant == PLAIN),
                                 ("paired_x_torch", variant == TORCH)):  # fmt: skip
                value = 1.0 if is_base else info.get(key)
                cells.append("" if value is None else f"{value:.2f}")
        if has_peak:
            peak = row["extra_info"].get("peak_bytes")
            cells.append(_mib(peak))
            for base_row in (plain, torch_row):
                base = base_row["extra_info"].get("peak_bytes") if base_row else None
                cells.append(f"{peak / base:.2f}" if peak and base else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_table(benchmarks: list[dict[str, Any]]) -> str:
    """Planned vs uniform at every k (bench/test_planner.py)."""
    rows: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for b in benchmarks:
        info = b["extra_info"]
        rows[info["k"]][info["variant"]] = {
            "ms": b["stats"]["median"] * 1e3,
            "peak": info["peak_bytes"],
            "predicted": info.get("predicted_peak_bytes"),
            "budget": info.get("budget_bytes"),
            "paired": info.get("paired_ratio"),
        }
    lines = [
        "| k | torch MiB | torch ms | plan@torch MiB | plan@torch ms | x torch "
        "(paired) | seqckpt MiB | seqckpt ms | plan@seqckpt MiB | plan@seqckpt ms "
        "| x seqckpt (paired) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios, errors, over, equal_time = [], [], [], []
    for k in sorted(rows):
        r = rows[k]
        cells = [str(k)]
        for kind in ("torch", "seqckpt"):
            u, p = r[f"{kind}_uniform"], r[f"planned_at_{kind}"]
            ratio = p["ms"] / u["ms"]
            paired = p["paired"] if p["paired"] is not None else ratio
            ratios.append((paired, kind, k))
            errors.append(abs(p["peak"] - p["predicted"]) / p["predicted"])
            over.append(p["peak"] / p["budget"])
            cells += [
                _mib(u["peak"]), f"{u['ms']:.1f}", _mib(p["peak"]), f"{p['ms']:.1f}",
                f"{ratio:.2f} ({paired:.2f})",
            ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
        eq = r.get("planned_equal_time")
        if eq is not None and eq["paired"] is not None and k > 1:
            saved = 1 - eq["peak"] / r["seqckpt_uniform"]["peak"]
            equal_time.append((saved, eq["paired"], k))
            errors.append(abs(eq["peak"] - eq["predicted"]) / eq["predicted"])
    worst = max(ratios)
    best = min(ratios)
    eq_lines = [
        "",
        "| k | seqckpt uniform MiB | equal-time plan MiB | memory saved | time x uniform (paired) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for saved, paired, k in equal_time:
        eq = rows[k]["planned_equal_time"]
        eq_lines.append(
            f"| {k} | {_mib(rows[k]['seqckpt_uniform']['peak'])} | {_mib(eq['peak'])} "
            f"| {100 * saved:.0f}% | {paired:.2f} |"
        )
    best_saving = max(equal_time) if equal_time else (0.0, 0.0, 0)
    lines += [
        "",
        "Ratios in parentheses are paired (alternating back-to-back steps, "
        "median of 11 pairs); the summary uses them.",
        "",
        f"- slowest plan against the uniform run whose peak was its budget: "
        f"{worst[0]:.2f}x ({worst[1]} k={worst[2]}); fastest {best[0]:.2f}x "
        f"({best[1]} k={best[2]}), i.e. {100 * (1 - best[0]):.0f}% faster at equal memory.",
        f"- equal time: at k={best_saving[2]} the least-memory plan predicted no "
        f"slower than seqckpt's uniform run needs {100 * best_saving[0]:.0f}% less "
        f"memory, measured at {best_saving[1]:.2f}x its time (paired).",
        f"- measured peak vs predicted: at most {100 * max(errors):.1f}% apart; "
        f"measured peak / budget at most {max(over):.3f}.",
    ]
    return "\n".join(lines + eq_lines)


def plan_at_torch_table(rows: list[dict[str, Any]]) -> str:
    """seqckpt.plan at each torch variant's peak (bench/test_selective.py)."""
    lines = [
        "| torch variant | torch MiB | plan MiB | plan x torch peak | time x torch "
        "(paired) | over plain: ours | over plain: torch | policies in the plan |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        info = row["extra_info"]
        lines.append(
            f"| {info['torch_variant']} | {_mib(info['budget_bytes'])} | "
            f"{_mib(info['peak_bytes'])} | "
            f"{info['peak_bytes'] / info['budget_bytes']:.3f} | "
            f"{info['paired_x_torch']:.2f} | {100 * info['overhead_ours']:+.0f}% | "
            f"{100 * info['overhead_torch']:+.0f}% | "
            f"{', '.join(info['policies']) or '-'} |"
        )
    return "\n".join(lines)


def best_k_table(rows: list[dict[str, Any]]) -> str:
    """The plan at torch's best uniform k's peak, per batch (resnet)."""
    lines = [
        "| batch | torch's best k | torch MiB | plan MiB | time x torch (paired) |",
        "|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for row in rows:
        info = row["extra_info"]
        ratios.append(info["paired_x_torch"])
        batch = info["variant"].split(":")[0].removeprefix("batch ")
        lines.append(
            f"| {batch} | {info['best_k']} | {_mib(info['budget_bytes'])} | "
            f"{_mib(info['peak_bytes'])} | {info['paired_x_torch']:.2f} |"
        )
    mean = sum(ratios) / len(ratios)
    lines += [
        "",
        f"Average: {mean:.2f}x torch's time ({100 * (1 - mean):.0f}% faster).",
    ]
    return "\n".join(lines)


def shapes_table(rows: list[dict[str, Any]]) -> str:
    """The stream of varying shapes (bench/test_shapes.py)."""
    info = rows[0]["extra_info"]
    budget = info["budget_bytes"]
    names = ("adaptive", "one_plan", "torch_every_block", "replan_per_shape")
    adaptive = info["total_adaptive"]
    lines = [
        f"{info['batches']} batches, {info['distinct_lengths']} distinct lengths, "
        f"budget {_mib(budget)} MiB; the adaptive frontier profiled "
        f"{info['profiles_adaptive']} time(s).",
        "",
        "| variant | total s | x adaptive | planning + profiling s | share of total "
        "| largest peak MiB | peak / budget |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        total, planning = info[f"total_{name}"], info[f"planning_{name}"]
        peak = info[f"peak_{name}"]
        lines.append(
            f"| {name} | {total:.2f} | {total / adaptive:.2f} | {planning:.3f} | "
            f"{100 * planning / total:.1f}% | {_mib(peak)} | {peak / budget:.3f} |"
        )
    return "\n".join(lines)


def solver_groups_table(rows: list[dict[str, Any]]) -> str:
    """Planning on groups of layers against the exact DP (test_solver_speed)."""
    lines = [
        "| chain and budget | exact plan: predicted step s | on 100 groups: "
        "predicted step s | loss | exact solve ms | solve on groups ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        info = row["extra_info"]
        lines.append(
            f"| {info['variant']} | {info['exact_seconds']:.4f} | "
            f"{info['grouped_seconds']:.4f} | {100 * info['loss']:+.2f}% | "
            f"{info['exact_solve_seconds'] * 1e3:.0f} | "
            f"{row['stats']['median'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


SPECIAL_TABLES = {
    "solver-groups": solver_groups_table,
    "shapes-gpt": shapes_table,
    "selective-plan-at-torch-gpt": plan_at_torch_table,
    "selective-resnet-best-k": best_k_table,
}


def report(paths: list[Path]) -> str:
    out: list[str] = []
    for path in paths:
        data = json.loads(path.read_text())
        info = data["machine_info"]
        device = info.get("gpu") or info.get("cpu", {}).get("brand_raw", "?")
        out.append(
            f"Run {data['datetime'][:19]} on {device}, torch {info.get('torch', '?')}, "
            f"Python {info.get('python_version')}, sizes `{info.get('bench_size', 'cpu')}`, "
            f"from `{path}`."
        )
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for bench in data["benchmarks"]:
            groups[bench["group"] or bench["name"]].append(bench)
        frontier = [
            b for g, rows in groups.items() if g.startswith("frontier-") for b in rows
        ]
        for group, rows in groups.items():
            if not group.startswith("frontier-"):
                out.append(f"\n#### {group}\n")
                out.append(SPECIAL_TABLES.get(group, group_table)(rows))
        if frontier:
            out.append("\n#### planner against uniform segments (resnet)\n")
            out.append(frontier_table(frontier))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/report.py RESULT.json [RESULT.json ...]")
    print(report([Path(p) for p in sys.argv[1:]]))
