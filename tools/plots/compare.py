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
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from align import ALIGNMENTS, Phases, align_times, find_phases
from common import (CommandParser, InputError, Output, command_parser, existing_dir,
                    load_json, positive, typed)
from traces import TRACE_GLOB, Iteration, last_iteration, trace_files, trace_rank

DESCRIPTION = f"""\
Compare real and simulated memory traces ({TRACE_GLOB}, paired by rank).

Writes to OUTPUT_DIR:
  memory_comparison_rank_{{R}}.png  allocated memory over the last iteration of each run
  comparison_summary.csv           per rank: peaks, static memory, peak time, memory
                                   after the forward passes and peak reserved memory
                                   (where both traces give it), with their errors (MiB, s)
  peak_overview.png                every rank's real and simulated peak

Errors are signed (sim - real), so a positive value means the simulation over-predicts;
abs_error_MB is |sim - real|. A trace without static_memory_MB has its static memory read
from the iteration's first sample (the *_static_from columns say which). The peak time is
when a curve first comes within 0.1% of its peak (a stage peaks once per microbatch).

When memsim wrote one trace per rank class (memsim simulate's default), a real rank
without a simulated trace of its own is compared with its class's: the class is read from
the summary_rank{{R}}.json files beside the simulated traces.

--align (default phases) puts the simulated iteration on the real one's clock:
  none    each run on its own clock, from its iteration's first sample
  start   the simulated iteration stretched uniformly to the real one's length
  phases  stretched piecewise so that forward, backward and optimizer start together;
          the phases are read from each curve's shape: backward starts where the
          memory first comes within 3% of its peak, the optimizer where it is back
          within 10% of the iteration's starting level after the last backward pass
          (a rank whose curve shows no phases is stretched uniformly, with a warning)"""

CSV_COLUMNS = ["rank", "real_peak_MB", "sim_peak_MB", "abs_error_MB", "rel_error_pct",
               "real_static_MB", "sim_static_MB", "static_error_MB", "real_static_from",
               "sim_static_from", "real_peak_time_s", "sim_peak_time_s", "peak_time_error_s",
               "real_after_forward_MB", "sim_after_forward_MB", "after_forward_error_MB",
               "real_peak_reserved_MB", "sim_peak_reserved_MB", "peak_reserved_error_MB",
               "sim_rank", "alignment"]
MB_PER_GB = 1024.0
SUMMARY = re.compile(r"^summary_rank(\d+)\.json$")
STATIC_FIELD, FIRST_SAMPLE = "static_memory_MB", "first_sample"


@dataclass(frozen=True)
class Pair:
    """The last iterations of a real and a simulated trace of one rank, the simulated
    one on the real one's clock."""

    rank: int
    sim_rank: int  # the rank whose simulated trace stands for `rank` (its rank class)
    real: Iteration
    sim: Iteration
    real_phases: Phases | None
    sim_phases: Phases | None
    sim_times_s: list[float]  # sim.times_s aligned to the real iteration
    alignment: str  # the alignment used: "phases" falls back to "start"


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
    p.add_argument("--align", choices=ALIGNMENTS, default="phases",
                   help="how the simulated clock is put on the real one (default: phases)")
    p.add_argument("--dpi", type=positive, default=100, help="PNG resolution (default: 100)")
    return p


def run(args: argparse.Namespace) -> None:
    """Loads every pair first, so bad input stops the command before any output."""
    pairs, warnings = load_pairs(args.real_dir, args.sim_dir, args.align)
    rows = [summary_row(pair) for pair in pairs]
    with Output() as out:
        for pair in pairs:
            out.save_figure(rank_figure(pair, args.show_theoretical), args.dpi,
                            args.output_dir / f"memory_comparison_rank_{pair.rank}.png")
        out.write_text(args.output_dir / "comparison_summary.csv", csv_text(rows))
        out.save_figure(peak_overview(rows), args.dpi, args.output_dir / "peak_overview.png")
    for warning in warnings:  # after the output, so an error is the only line printed
        print(f"memsim compare: warning: {warning}", file=sys.stderr)
    print(table_text(rows))
    print(f"\nWrote {len(pairs)} comparison plot(s), comparison_summary.csv and "
          f"peak_overview.png to {args.output_dir}/")


def load_pairs(real_dir: Path, sim_dir: Path, alignment: str) -> tuple[list[Pair], list[str]]:
    """Pairs real and simulated traces by rank, a real rank without a simulated trace
    with its rank class's, and says what it skipped or could not align."""
    real = traces_by_rank(real_dir, "real")
    sim = traces_by_rank(sim_dir, "simulated")
    classes = rank_classes(sim_dir, sim, real)
    partner = {rank: rank if rank in sim else classes[rank] for rank in real
               if rank in sim or rank in classes}
    if not partner:
        raise InputError(f"no rank has both a real trace in {real_dir} (ranks "
                         f"{_ranks(real)}) and a simulated one in {sim_dir} (ranks "
                         f"{_ranks(sim)}); point -r and -s at traces of the same ranks")
    iterations = {path: plottable(path) for path in
                  {real[r] for r in partner} | {sim[r] for r in partner.values()}}
    pairs = [make_pair(rank, sim_rank, iterations[real[rank]], iterations[sim[sim_rank]],
                       alignment) for rank, sim_rank in sorted(partner.items())]
    warnings = [f"rank {rank} has a real trace ({real[rank]}) but no simulated one, nor a "
                "summary_rank{R}.json placing it in a simulated rank class; skipped"
                for rank in sorted(set(real) - set(partner))]
    warnings += [f"rank {rank} has a simulated trace ({sim[rank]}) but no real one; skipped"
                 for rank in sorted(set(sim) - set(partner.values()))]
    warnings += [f"rank {pair.rank}: the {'real' if pair.real_phases is None else 'simulated'} "
                 "curve shows no forward, backward and optimizer phases (see --help); its "
                 "simulated iteration is stretched uniformly instead"
                 for pair in pairs if alignment == "phases" and pair.alignment != "phases"]
    return pairs, warnings


def make_pair(rank: int, sim_rank: int, real: Iteration, sim: Iteration,
              alignment: str) -> Pair:
    """A pair with both curves' phases and the simulated clock aligned to the real one."""
    real_phases = find_phases(real.times_s, real.allocated_mb)
    sim_phases = find_phases(sim.times_s, sim.allocated_mb)
    times, used = align_times(sim.times_s, sim_phases, real.times_s[-1], real_phases,
                              alignment)
    return Pair(rank, sim_rank, real, sim, real_phases, sim_phases, times, used)


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


def rank_classes(sim_dir: Path, sim: dict[int, Path], wanted: Iterable[int]) -> dict[int, int]:
    """{rank: the simulated rank standing for it} for each rank of `wanted` some class holds,
    from the "ranks" ([first, last] spans) of every summary_rank{R}.json in `sim_dir` whose
    rank R has a simulated trace."""
    spans: list[tuple[int, int, int]] = []
    for path in sorted(sim_dir.iterdir()):
        match = SUMMARY.match(path.name)
        if not match or int(match.group(1)) not in sim:
            continue
        summary = load_json(path)
        where = str(path)
        members = typed(summary, "ranks", list, where) if isinstance(summary, dict) else None
        if members is None or not all(_is_span(span) for span in members):
            raise InputError(f"{where}: 'ranks' must be a list of [first, last] rank spans; "
                             "regenerate it with memsim simulate")
        spans += [(first, last, int(match.group(1))) for first, last in members]
    classes: dict[int, int] = {}
    for rank in wanted:
        for first, last, sim_rank in spans:
            if first <= rank <= last:
                classes.setdefault(rank, sim_rank)
    return classes


def _is_span(span: Any) -> bool:
    """[first, last] with 0 <= first <= last, both integers."""
    return (isinstance(span, list) and len(span) == 2
            and all(isinstance(r, int) and not isinstance(r, bool) for r in span)
            and 0 <= span[0] <= span[1])


def _ranks(by_rank: dict[int, Path]) -> str:
    return ", ".join(str(r) for r in sorted(by_rank))


def static_of(iteration: Iteration) -> tuple[float, str]:
    """An iteration's static memory and where it was read: the trace's field, or the
    first sample (the memory the iteration starts from) when the field is absent."""
    if iteration.static_mb is not None:
        return iteration.static_mb, STATIC_FIELD
    return iteration.allocated_mb[0], FIRST_SAMPLE


# Peaks this close to an iteration's largest sample count as the peak: a pipeline stage
# reaches the same peak once per microbatch (within a MiB or so), and which of them is
# largest by a few bytes says nothing, so both curves take their first.
PEAK_TIME_TOLERANCE = 0.001


def peak_time(times_s: list[float], allocated_mb: list[float]) -> float:
    """When the curve first comes within PEAK_TIME_TOLERANCE of its largest sample."""
    values = np.asarray(allocated_mb)
    return times_s[int(np.argmax(values >= values.max() * (1 - PEAK_TIME_TOLERANCE)))]


def peak_reserved(iteration: Iteration) -> float | None:
    """The iteration's largest reserved sample; None when its trace gives no reserved memory
    (its samples' reserved values are then the allocated ones)."""
    return max(iteration.reserved_mb) if iteration.has_reserved else None


def summary_row(pair: Pair) -> dict[str, float | int | str | None]:
    """One CSV row; values are None where a curve shows no phases."""
    real, sim = pair.real.peak_allocated_mb, pair.sim.peak_allocated_mb
    (real_static, real_from), (sim_static, sim_from) = static_of(pair.real), static_of(pair.sim)
    real_time = peak_time(pair.real.times_s, pair.real.allocated_mb)
    sim_time = peak_time(pair.sim_times_s, pair.sim.allocated_mb)
    real_reserved = peak_reserved(pair.real)
    sim_reserved = peak_reserved(pair.sim)
    real_fwd = pair.real_phases.after_forward_mb if pair.real_phases else None
    sim_fwd = pair.sim_phases.after_forward_mb if pair.sim_phases else None
    return {
        "rank": pair.rank,
        "real_peak_MB": real,
        "sim_peak_MB": sim,
        "abs_error_MB": abs(sim - real),
        "rel_error_pct": (sim - real) / real * 100 if real > 0 else None,
        "real_static_MB": real_static,
        "sim_static_MB": sim_static,
        "static_error_MB": sim_static - real_static,
        "real_static_from": real_from,
        "sim_static_from": sim_from,
        "real_peak_time_s": real_time,
        "sim_peak_time_s": sim_time,
        "peak_time_error_s": sim_time - real_time,
        "real_after_forward_MB": real_fwd,
        "sim_after_forward_MB": sim_fwd,
        "after_forward_error_MB": (sim_fwd - real_fwd
                                   if real_fwd is not None and sim_fwd is not None else None),
        "real_peak_reserved_MB": real_reserved,
        "sim_peak_reserved_MB": sim_reserved,
        "peak_reserved_error_MB": (sim_reserved - real_reserved
                                   if real_reserved is not None and sim_reserved is not None
                                   else None),
        "sim_rank": pair.sim_rank,
        "alignment": pair.alignment,
    }


def csv_text(rows: list[dict]) -> str:
    """The summary as CSV; numbers are written exactly (repr), missing values empty."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v if isinstance(v, str) else repr(v)
                         for k, v in row.items()})
    return buffer.getvalue()


# (header, key, format) of the terminal table; "signed" cells are errors.
TABLE = [("rank", "rank", "rank"), ("real peak MiB", "real_peak_MB", "mb"),
         ("sim peak MiB", "sim_peak_MB", "mb"), ("error %", "rel_error_pct", "signed"),
         ("real static MiB", "real_static_MB", "mb"), ("sim static MiB", "sim_static_MB", "mb"),
         ("static err MiB", "static_error_MB", "signed"),
         ("real peak at s", "real_peak_time_s", "s"), ("sim peak at s", "sim_peak_time_s", "s"),
         ("real after fwd MiB", "real_after_forward_MB", "mb"),
         ("sim after fwd MiB", "sim_after_forward_MB", "mb"),
         ("after fwd err MiB", "after_forward_error_MB", "signed")]


def table_text(rows: list[dict]) -> str:
    """The summary as an aligned table for the terminal, with notes on what was mapped,
    aligned or read from a first sample."""
    lines = [[header for header, _, _ in TABLE]]
    lines += [[_cell(row, key, kind) for _, key, kind in TABLE] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE))]
    text = "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths))
                     for line in lines)
    return text + "".join(f"\n{note}" for note in table_notes(rows))


def table_notes(rows: list[dict]) -> list[str]:
    notes = []
    mapped = [r for r in rows if r["sim_rank"] != r["rank"]]
    if mapped:
        notes.append("rank class: " + ", ".join(f"rank {r['rank']} is compared with "
                                                f"simulated rank {r['sim_rank']}"
                                                for r in mapped))
    for side in ("real", "sim"):
        first = [str(r["rank"]) for r in rows if r[f"{side}_static_from"] == FIRST_SAMPLE]
        if first:
            notes.append(f"* {side} static memory of rank(s) {', '.join(first)} is the "
                         "iteration's first sample: the trace has no static_memory_MB")
    used = sorted({r["alignment"] for r in rows})
    notes.append(f"times: seconds from the start of the real iteration; simulated time "
                 f"aligned by {' and '.join(used)}")
    return notes


def _cell(row: dict, key: str, kind: str) -> str:
    value = row[key]
    if value is None:
        return "-"
    if kind == "rank":
        return str(value)
    if kind == "signed":
        return signed(value)
    if kind == "s":
        return f"{value:.3f}"
    star = "*" if key.endswith("_static_MB") and row[f"{key[:-3]}_from"] == FIRST_SAMPLE else ""
    return f"{star}{value:.1f}"


def signed(value: float, decimals: int = 2) -> str:
    """A signed error with `decimals` decimals; one that rounds to zero is "0.00", never
    "-0.00"."""
    rounded = round(value, decimals)
    return f"{0.0:.{decimals}f}" if rounded == 0 else f"{rounded:+.{decimals}f}"


def memory_unit(largest_mb: float) -> tuple[str, float]:
    """GiB once values reach a gibibyte (readable tick labels), else MiB."""
    return ("GiB", MB_PER_GB) if largest_mb >= MB_PER_GB else ("MiB", 1.0)


def zoomed_limits(values: list[float], margin: float = 0.08) -> tuple[float, float]:
    """A y range around `values` with `margin` of their span above and below, so the band
    where curves differ fills the plot and no plateau touches the frame; never below 0."""
    low, high = min(values), max(values)
    pad = margin * (high - low) if high > low else max(abs(high) * margin, 1.0)
    return max(0.0, low - pad), high + pad


ALIGNMENT_LABEL = {"none": "simulated time on its own clock",
                   "start": "simulated iteration stretched to the real one's length",
                   "phases": "simulated phases stretched to the real ones"}


def rank_figure(pair: Pair, show_theoretical: bool) -> plt.Figure:
    """Allocated memory over the last iteration, real solid and simulated dashed, the
    real phases marked, the y axis zoomed to the data and the legend beside it."""
    unit, scale = memory_unit(max(max(pair.real.allocated_mb), max(pair.sim.allocated_mb)))
    sim_label = f"Simulation (iteration {pair.sim.number})"
    if pair.sim_rank != pair.rank:
        sim_label = (f"Simulation (iteration {pair.sim.number}, rank {pair.sim_rank}: "
                     f"same rank class)")
    curves = [(pair.real, pair.real.times_s, "-", f"Real run (iteration {pair.real.number})",
               "tab:blue", "real run"),
              (pair.sim, pair.sim_times_s, "--", sim_label, "tab:orange", "simulation")]
    fig, ax = plt.subplots(figsize=(11, 5))
    shown = []
    for it, times, style, label, color, _ in curves:
        values = [v / scale for v in it.allocated_mb]
        ax.plot(times, values, linestyle=style, color=color, linewidth=1.5, label=label)
        shown += values
    for it, _, style, _, _, name in curves:
        static, source = static_of(it)
        suffix = " (first sample)" if source == FIRST_SAMPLE else ""
        ax.axhline(static / scale, color="green", linestyle=style, linewidth=1.2,
                   label=f"Static memory, {name}{suffix}")
        shown.append(static / scale)
        if show_theoretical and it.theoretical_mb is not None:
            ax.axhline(it.theoretical_mb / scale, color="red", linestyle=style,
                       linewidth=1.2, label=f"Theoretical memory, {name}")
            shown.append(it.theoretical_mb / scale)
    if pair.real_phases is not None:
        for at, phase in ((pair.real_phases.backward_s, "backward"),
                          (pair.real_phases.optimizer_s, "optimizer")):
            ax.axvline(at, color="grey", linestyle=":", linewidth=1.0)
            ax.annotate(f"{phase} →", (at, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -12), textcoords="offset points", fontsize=8,
                        color="grey")
    ax.set_ylim(*zoomed_limits(shown))
    ax.set_title(f"Memory usage, rank {pair.rank}: real vs simulated")
    ax.set_xlabel(f"Time since the start of the real iteration (s); "
                  f"{ALIGNMENT_LABEL[pair.alignment]}")
    ax.set_ylabel(f"Allocated memory ({unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=9)
    return fig


def peak_overview(rows: list[dict]) -> plt.Figure:
    """Every rank's real and simulated peak as grouped bars from zero, signed errors above
    the pairs, the legend outside the bars."""
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
                ax.annotate(f"{signed(row['rel_error_pct'])}%", (xi, top), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [str(r["rank"]) for r in rows])
    ax.set_xlabel("Rank")
    ax.set_ylabel(f"Peak allocated memory ({unit})")
    ax.set_title("Peak allocated memory, real vs simulated")
    ax.margins(y=0.12)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=9)
    return fig
