"""memsim compare: real vs simulated memory traces, rank by rank.

Draws what Megatron-LM's standalone memory visualizer draws (the last iteration of each
run, real solid, simulated dashed, static memory green, theoretical memory red on
request), and adds what that tool leaves to the reader: a peak-error table
(comparison_summary.csv) and one figure of every rank's real and simulated peak.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from common import (CommandParser, InputError, Output, command_parser, existing_dir,
                    positive)
from traces import TRACE_GLOB, Iteration, last_iteration, trace_files, trace_rank

DESCRIPTION = f"""\
Compare real and simulated memory traces ({TRACE_GLOB}, paired by rank).

Writes to OUTPUT_DIR:
  memory_comparison_rank_{{R}}.png  allocated memory over the last iteration of each run
  comparison_summary.csv           per rank: peaks, errors and static memory (MiB)
  peak_overview.png                every rank's real and simulated peak

abs_error_MB is |sim - real|; rel_error_pct and static_error_MB are signed (sim - real),
so a positive value means the simulation over-predicts."""

CSV_COLUMNS = ["rank", "real_peak_MB", "sim_peak_MB", "abs_error_MB", "rel_error_pct",
               "real_static_MB", "sim_static_MB", "static_error_MB"]
MB_PER_GB = 1024.0


@dataclass(frozen=True)
class Pair:
    """The last iterations of a real and a simulated trace of one rank."""

    rank: int
    real: Iteration
    sim: Iteration


def parser() -> CommandParser:
    """Options mirror Megatron's visualize_memory_traces.sh (-r, -s, -o, -t)."""
    p = command_parser("compare", DESCRIPTION)
    p.add_argument("-r", "--real-dir", type=Path, required=True,
                   help="folder with the real run's memory traces")
    p.add_argument("-s", "--sim-dir", type=Path, required=True,
                   help="folder with the simulated run's memory traces")
    p.add_argument("-o", "--output-dir", type=Path, default=Path("memory_plots"),
                   help="folder for the plots and the summary (default: memory_plots)")
    p.add_argument("-t", "--show-theoretical", action="store_true",
                   help="draw theoretical memory as red lines (default: off)")
    p.add_argument("--dpi", type=positive, default=100, help="PNG resolution (default: 100)")
    return p


def run(args: argparse.Namespace) -> None:
    """Loads every pair first, so bad input stops the command before any output."""
    pairs = load_pairs(args.real_dir, args.sim_dir)
    rows = [summary_row(pair) for pair in pairs]
    with Output() as out:
        for pair in pairs:
            out.save_figure(rank_figure(pair, args.show_theoretical), args.dpi,
                            args.output_dir / f"memory_comparison_rank_{pair.rank}.png")
        out.write_text(args.output_dir / "comparison_summary.csv", csv_text(rows))
        out.save_figure(peak_overview(rows), args.dpi, args.output_dir / "peak_overview.png")
    print(table_text(rows))
    print(f"\nWrote {len(pairs)} comparison plot(s), comparison_summary.csv and "
          f"peak_overview.png to {args.output_dir}/")


def load_pairs(real_dir: Path, sim_dir: Path) -> list[Pair]:
    """Pairs real and simulated traces by rank; ranks on one side only are skipped."""
    real = traces_by_rank(real_dir, "real")
    sim = traces_by_rank(sim_dir, "simulated")
    common = sorted(real.keys() & sim.keys())
    if not common:
        raise InputError(f"no rank has both a real trace in {real_dir} (ranks "
                         f"{_ranks(real)}) and a simulated one in {sim_dir} (ranks "
                         f"{_ranks(sim)}); point -r and -s at traces of the same ranks")
    pairs = [Pair(rank, plottable(real[rank]), plottable(sim[rank])) for rank in common]
    for rank in sorted(real.keys() ^ sim.keys()):  # after loading: errors stay one line
        has, lacks = ("real", "simulated") if rank in real else ("simulated", "real")
        print(f"memsim compare: warning: rank {rank} has a {has} trace "
              f"({real.get(rank) or sim[rank]}) but no {lacks} one; skipped", file=sys.stderr)
    return pairs


def plottable(path: Path) -> Iteration:
    """The last iteration of a trace, which must have samples to draw."""
    iteration = last_iteration(path)
    if not iteration.times_s:
        raise InputError(f"{path}: iteration {iteration.number} has no samples to plot; "
                         "the tracer recorded no allocations, rerun with tracing enabled")
    return iteration


def traces_by_rank(folder: Path, side: str) -> dict[int, Path]:
    """{rank: trace file} of one side; two files of one rank are ambiguous."""
    flag = "-r" if side == "real" else "-s"
    existing_dir(folder, f"{side} trace folder", f"pass {flag} the folder with {TRACE_GLOB}")
    by_rank: dict[int, Path] = {}
    for path in trace_files(folder, f"pass {flag} the folder the memory tracer wrote"):
        rank = trace_rank(path)
        if rank in by_rank:
            raise InputError(f"{by_rank[rank]} and {path} are both rank {rank}; keep one "
                             f"trace per rank in {folder}")
        by_rank[rank] = path
    return by_rank


def _ranks(by_rank: dict[int, Path]) -> str:
    return ", ".join(str(r) for r in sorted(by_rank))


def summary_row(pair: Pair) -> dict[str, float | int | None]:
    """One CSV row; errors are None where an input is missing."""
    real, sim = pair.real.peak_allocated_mb, pair.sim.peak_allocated_mb
    real_static, sim_static = pair.real.static_mb, pair.sim.static_mb
    return {
        "rank": pair.rank,
        "real_peak_MB": real,
        "sim_peak_MB": sim,
        "abs_error_MB": abs(sim - real),
        "rel_error_pct": (sim - real) / real * 100 if real > 0 else None,
        "real_static_MB": real_static,
        "sim_static_MB": sim_static,
        "static_error_MB": (sim_static - real_static
                            if real_static is not None and sim_static is not None else None),
    }


def csv_text(rows: list[dict]) -> str:
    """The summary as CSV; peaks are written exactly (repr), missing values empty."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else repr(v) for k, v in row.items()})
    return buffer.getvalue()


def table_text(rows: list[dict]) -> str:
    """The summary as an aligned table for the terminal."""
    header = ["rank", "real peak MiB", "sim peak MiB", "|error| MiB", "error %",
              "real static MiB", "sim static MiB", "static err MiB"]
    lines = [header] + [[str(row["rank"])] + [_cell(row[k]) for k in CSV_COLUMNS[1:]]
                        for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths))
                     for line in lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def memory_unit(largest_mb: float) -> tuple[str, float]:
    """GB once values reach a gigabyte (readable tick labels), else MB."""
    return ("GiB", MB_PER_GB) if largest_mb >= MB_PER_GB else ("MiB", 1.0)


def rank_figure(pair: Pair, show_theoretical: bool) -> plt.Figure:
    """Allocated memory over the last iteration, real solid and simulated dashed."""
    runs = [(pair.real, "-", "Real run", "tab:blue"), (pair.sim, "--", "Simulation", "tab:orange")]
    unit, scale = memory_unit(max(max(pair.real.allocated_mb), max(pair.sim.allocated_mb)))
    fig, ax = plt.subplots(figsize=(10, 5))
    for it, style, label, color in runs:
        ax.plot(it.times_s, [v / scale for v in it.allocated_mb], linestyle=style,
                color=color, linewidth=1.5, label=f"{label} (iteration {it.number})")
    for it, style, label, _ in runs:
        if it.static_mb is not None:
            ax.axhline(it.static_mb / scale, color="green", linestyle=style, linewidth=1.2,
                       label=f"Static memory, {label.lower()}")
        if show_theoretical and it.theoretical_mb is not None:
            ax.axhline(it.theoretical_mb / scale, color="red", linestyle=style, linewidth=1.2,
                       label=f"Theoretical memory, {label.lower()}")
    ax.set_title(f"Memory usage, rank {pair.rank}: real vs simulated")
    ax.set_xlabel("Time since the start of the iteration (s)")
    ax.set_ylabel(f"Allocated memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    return fig


def peak_overview(rows: list[dict]) -> plt.Figure:
    """Every rank's real and simulated peak as grouped bars, errors above the pairs."""
    unit, scale = memory_unit(max(max(r["real_peak_MB"], r["sim_peak_MB"]) for r in rows))
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4.5))
    real = [r["real_peak_MB"] / scale for r in rows]
    sim = [r["sim_peak_MB"] / scale for r in rows]
    ax.bar(x - 0.2, real, width=0.4, color="tab:blue", label="Real run")
    ax.bar(x + 0.2, sim, width=0.4, color="tab:orange", hatch="//", edgecolor="white",
           label="Simulation")
    if len(rows) <= 16:
        for xi, row, top in zip(x, rows, map(max, real, sim)):
            if row["rel_error_pct"] is not None:
                ax.annotate(f"{row['rel_error_pct']:+.1f}%", (xi, top), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [str(r["rank"]) for r in rows])
    ax.set_xlabel("Rank")
    ax.set_ylabel(f"Peak allocated memory ({unit})")
    ax.set_title("Peak allocated memory, real vs simulated")
    ax.margins(y=0.12)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    return fig
