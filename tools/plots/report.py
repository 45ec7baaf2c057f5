"""memsim report: the memory of a simulated run, per rank (class), from the files
`memsim simulate` writes: summary_rank{R}.json, and memory_trace_rank{R}.json when present.

It answers "what made the peak": the per-phase peaks, the modules holding memory at the
peak with repeated layers merged (decoder.layers.* instead of 96 lines), and the tensors
alive at the peak grouped by where they come from.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from common import (CommandParser, InputError, Output, command_parser, existing_dir,
                    load_json, number, optional_number, positive, typed)
from traces import Iteration, load_trace

DESCRIPTION = """\
Report a memsim run folder (summary_rank{R}.json, optionally memory_trace_rank{R}.json).

Writes to OUTPUT_DIR (default RUN_DIR/report), per rank R:
  phases_rank{R}.png    peak allocated memory per phase, with static memory
  modules_rank{R}.png   memory at the peak by module, repeated layers merged (layers.*)
  tensors_rank{R}.png   tensors alive at the peak grouped by module pattern and op
  timeline_rank{R}.png  allocated and reserved memory over time (when a trace exists)
and report.txt with the same tables for every rank."""

OPTIONAL_NUMBERS = ("peak_reserved_MB", "static_memory_MB", "theoretical_memory_MB",
                    "peak_time_s", "gpu_usable_MB", "headroom_MB")
SUMMARY = re.compile(r"^summary_rank(\d+)\.json$")
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")
TOP_IN_FIGURES = 20


@dataclass(frozen=True)
class Group:
    """Memory merged under one key: a module pattern, or (module pattern, op)."""

    key: tuple[str, ...]
    mb: float
    count: int


@dataclass(frozen=True)
class RankReport:
    """One summary, reduced to what the report shows."""

    rank: int
    summary: dict
    phases: dict[str, float]  # phase -> peak allocated MiB, in training order
    phase_order: list[str]  # memsim's phases in training order (the summary's enum_names)
    modules: list[Group]  # (module pattern,), largest first
    tensors: list[Group]  # (module pattern, op), largest first
    trace: list[Iteration] | None

    def number(self, key: str) -> float | None:
        """A numeric summary field, validated by load_report (None when absent)."""
        value = self.summary.get(key)
        return None if value is None else float(value)


def parser() -> CommandParser:
    p = command_parser("report", DESCRIPTION)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the folder memsim simulate wrote (its --out)")
    p.add_argument("-o", "--output-dir", type=Path,
                   help="where to write the report (default: RUN_DIR/report)")
    p.add_argument("--dpi", type=positive, default=120, help="PNG resolution (default: 120)")
    return p


def run(args: argparse.Namespace) -> None:
    """Reads every rank's files, then writes the figures and report.txt."""
    reports = load_reports(args.run_dir)
    out_dir = args.output_dir or args.run_dir / "report"
    with Output() as out:
        for r in reports:
            out.save_figure(phases_figure(r), args.dpi, out_dir / f"phases_rank{r.rank}.png")
            out.save_figure(groups_figure(r, r.modules, "modules"), args.dpi,
                            out_dir / f"modules_rank{r.rank}.png")
            out.save_figure(groups_figure(r, r.tensors, "tensors"), args.dpi,
                            out_dir / f"tensors_rank{r.rank}.png")
            if r.trace:
                out.save_figure(timeline_figure(r), args.dpi,
                                out_dir / f"timeline_rank{r.rank}.png")
        out.write_text(out_dir / "report.txt", report_text(args.run_dir, reports))
    for r in reports:
        print(headline(r))
    print(f"Wrote report.txt and figures for {len(reports)} rank(s) to {out_dir}/")


def load_reports(run_dir: Path) -> list[RankReport]:
    """Every summary_rank{R}.json in the folder, by rank."""
    existing_dir(run_dir, "run folder", "pass the folder memsim simulate wrote (its --out)")
    files = sorted((int(m[1]), p) for p in run_dir.iterdir() if (m := SUMMARY.match(p.name)))
    if not files:
        raise InputError(f"no summary_rank{{R}}.json in {run_dir}; pass the folder memsim "
                         "simulate wrote (its --out)")
    return [load_report(rank, path) for rank, path in files]


def load_report(rank: int, path: Path) -> RankReport:
    """One rank's summary (validated) and, when present, its trace."""
    summary = load_json(path)
    if not isinstance(summary, dict):
        raise InputError(f"{path}: expected a JSON object; not a memsim summary")
    number(summary, "peak_allocated_MB", str(path))
    for key in OPTIONAL_NUMBERS:
        optional_number(summary, key, str(path))
    order = phase_order(summary, str(path))
    phases = typed(summary, "phases", dict, str(path))
    peaks = {}
    for phase in in_phase_order(phases, order):
        entry = phases[phase]
        if not isinstance(entry, dict):
            raise InputError(f"{path}: phases.{phase} is not an object")
        peaks[phase] = number(entry, "peak_allocated_MB", f"{path}: phases.{phase}")
    trace_path = path.with_name(f"memory_trace_rank{rank}.json")
    return RankReport(
        rank=rank,
        summary=summary,
        phases=peaks,
        phase_order=order,
        modules=group(_records(summary, "modules_at_peak", ("module",), "MB", path)),
        tensors=group(_records(summary, "largest_tensors_at_peak", ("module", "op"),
                               "size_MB", path)),
        trace=load_trace(trace_path) if trace_path.is_file() else None,
    )


def phase_order(summary: dict, where: str) -> list[str]:
    """memsim's phases in training order, as the summary names them (its enum_names, which
    memsim writes from the table it prints and parses with: Note [Enum names])."""
    names = typed(summary, "enum_names", dict, where)
    order = typed(names, "phase", list, f"{where}: enum_names")
    if not all(isinstance(phase, str) for phase in order):
        raise InputError(f"{where}: enum_names.phase must be a list of names")
    return order


def in_phase_order(phases: Iterable[str], order: list[str]) -> list[str]:
    """`phases` in training order; phases the order does not name go last."""
    return sorted(phases, key=lambda p: order.index(p) if p in order else len(order))


def _records(summary: dict, key: str, fields: tuple[str, ...], mb_key: str,
             path: Path) -> list[tuple[tuple[str, ...], float]]:
    """(key fields, MB) of each entry of a list in the summary, validated."""
    records = []
    for i, entry in enumerate(typed(summary, key, list, str(path))):
        where = f"{path}: {key}[{i}]"
        if not isinstance(entry, dict):
            raise InputError(f"{where} is not an object")
        names = tuple(typed(entry, field, str, where) for field in fields)
        records.append((names, number(entry, mb_key, where)))
    return records


def module_pattern(module: str) -> str:
    """decoder.layers.3.mlp -> decoder.layers.*.mlp: repeated layers become one line."""
    return _LAYER_INDEX.sub(".*", module)


def group(records: list[tuple[tuple[str, ...], float]]) -> list[Group]:
    """Merges records whose module (the first field) has the same pattern."""
    mb: dict[tuple[str, ...], float] = defaultdict(float)
    count: dict[tuple[str, ...], int] = defaultdict(int)
    for names, size in records:
        key = (module_pattern(names[0]), *names[1:])
        mb[key] += size
        count[key] += 1
    return sorted((Group(k, mb[k], count[k]) for k in mb), key=lambda g: (-g.mb, g.key))


def title(r: RankReport) -> str:
    """The rank's heading, e.g. Rank 8 (H100-80GB; class 1; pipeline stage 2; stands for
    ranks 8-15), from what the summary has."""
    s = r.summary
    parts = [str(s["gpu"])] if s.get("gpu") else []
    if s.get("rank_class") is not None:
        parts.append(f"class {s['rank_class']}")
    if s.get("pp_stage") is not None:
        parts.append(f"pipeline stage {s['pp_stage']}")
    if isinstance(s.get("ranks"), list) and s["ranks"]:
        parts.append("stands for ranks " + _ranges(s["ranks"]))
    return f"Rank {r.rank}" + (f" ({'; '.join(parts)})" if parts else "")


def _ranges(spans: list) -> str:
    """[[0, 2], [5, 5]] ([first, last] spans, as memsim writes "ranks") -> "0-2, 5"."""
    pairs = [span for span in spans if isinstance(span, list) and len(span) == 2
             and all(isinstance(r, int) for r in span)]
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in pairs)


def headline(r: RankReport) -> str:
    """Peak, where it happens, static and headroom in one line."""
    fields = [f"peak allocated {_mb(r.number('peak_allocated_MB'))}"]
    if isinstance(r.summary.get("peak_phase"), str):
        when = r.number("peak_time_s")
        fields[0] += f" in {r.summary['peak_phase']}" + (f" at t={when:.3f} s" if when else "")
    for key, name in (("peak_reserved_MB", "peak reserved"), ("static_memory_MB", "static"),
                      ("gpu_usable_MB", "usable"), ("headroom_MB", "headroom")):
        if r.number(key) is not None:
            fields.append(f"{name} {_mb(r.number(key))}")
    theoretical = r.number("theoretical_memory_MB")
    if theoretical is not None and theoretical > 0:
        fields.append(f"theoretical {_mb(theoretical)}")
    return f"{title(r)}: " + ", ".join(fields)


def _mb(value: float) -> str:
    return f"{value:,.1f} MiB"


def report_text(run_dir: Path, reports: list[RankReport]) -> str:
    """report.txt: per rank, memory by phase, by module, and the tensors at the peak."""
    lines = [f"memsim report for {run_dir}", ""]
    for r in reports:
        lines += [f"==== {headline(r)}", "", "-- Memory by phase",
                  *_table(["phase", "peak allocated MiB"],
                          [[p, f"{mb:,.1f}"] for p, mb in r.phases.items()], 1)]
        if r.number("static_memory_MB") is not None:
            lines.append(f"static memory (last iteration): {_mb(r.number('static_memory_MB'))}")
        breakdown = r.summary.get("breakdown_at_peak_MB")
        if isinstance(breakdown, dict):
            lines.append("at the peak: " + ", ".join(
                f"{k} {v:,.1f}" for k, v in breakdown.items() if isinstance(v, (int, float))) +
                " (MiB)")
        lines += ["", f"-- Memory by module (the {sum(g.count for g in r.modules)} modules "
                  "the summary lists at the peak; layers.N merged into layers.*)",
                  *_table(["module", "MiB", "modules"],
                          [[g.key[0], f"{g.mb:,.1f}", str(g.count)] for g in r.modules], 1),
                  "", f"-- Tensors alive at the peak (the {sum(g.count for g in r.tensors)} "
                  "largest, grouped by module pattern and op)",
                  *_table(["module", "op", "MiB", "tensors"],
                          [[*g.key, f"{g.mb:,.1f}", str(g.count)] for g in r.tensors], 2), ""]
        lines += advice_lines(r.summary.get("advice"))
    return "\n".join(lines)


def advice_lines(advice: object) -> list[str]:
    """What would cut the peak, as memsim simulate --advise measured it by re-simulating."""
    if not isinstance(advice, list) or not advice:
        return []
    rows = []
    for a in advice:
        if not isinstance(a, dict) or not all(k in a for k in ("change", "peak_reserved_MB", "fits",
                                                              "step_time_ratio", "effect")):
            raise ValueError("summary: an 'advice' entry lacks change, effect, peak_reserved_MB, "
                             "fits or step_time_ratio")
        rows.append([str(a["change"]), str(a["effect"]), "yes" if a["fits"] else "no",
                     f"{float(a['peak_reserved_MB']):,.1f}",
                     f"{(float(a['step_time_ratio']) - 1) * 100:+.1f}%"])
    return ["-- What would cut the peak (each switch re-simulated by memsim simulate --advise)",
            *_table(["change", "what it does", "fits", "peak reserved MiB", "step time"], rows, 3),
            ""]


def _table(header: list[str], rows: list[list[str]], text_columns: int) -> list[str]:
    """Aligned columns: the first `text_columns` left-aligned, the numbers right."""
    if not rows:
        return ["(none)"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) if i < text_columns else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths)))
            for row in [header, *rows]]


def phases_figure(r: RankReport) -> plt.Figure:
    """Per-phase peak allocated memory, static memory and the GPU's usable memory."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names, values = list(r.phases), [mb / 1024 for mb in r.phases.values()]
    bars = ax.bar(names, values, color="#4c72b0", width=0.6)
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, value), ha="center",
                    va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    for key, label, colour, style in (("static_memory_MB", "static memory", "green", "--"),
                                      ("gpu_usable_MB", "usable GPU memory", "red", ":")):
        if r.number(key) is not None:
            ax.axhline(r.number(key) / 1024, color=colour, linestyle=style,
                       label=f"{label} ({r.number(key) / 1024:.2f} GiB)")
    ax.set_ylabel("Peak allocated memory (GiB)")
    ax.set_title(f"{title(r)}: memory by phase", fontsize=10)
    ax.margins(y=0.15)
    ax.grid(True, axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2,
                  frameon=False)
    return fig


def groups_figure(r: RankReport, groups: list[Group], what: str) -> plt.Figure:
    """The largest module patterns (what="modules") or tensor groups as horizontal bars."""
    top = groups[:TOP_IN_FIGURES]
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.32 * len(top) + 1.5)))
    heading = ("memory by module at the peak" if what == "modules"
               else "tensors alive at the peak, by module and op")
    ax.set_title(f"{title(r)}: {heading}", fontsize=10)
    if not top:
        ax.text(0.5, 0.5, f"the summary lists no {what}", ha="center", va="center",
                transform=ax.transAxes, color="#666666")
        ax.set_axis_off()
        return fig
    y = np.arange(len(top))
    ax.barh(y, [g.mb / 1024 for g in top], color="#4c72b0" if what == "modules" else "#dd8452")
    unit = "modules" if what == "modules" else "tensors"
    ax.set_yticks(y, [f"{'  '.join(g.key)}  (x{g.count} {unit})" if g.count > 1
                      else "  ".join(g.key) for g in top], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("Memory (GiB)")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def timeline_figure(r: RankReport) -> plt.Figure:
    """Allocated and reserved memory over the whole trace, the peak marked."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for it in r.trace:
        times = [it.start_s + t for t in it.times_s]
        first = it is r.trace[0]
        ax.plot(times, [v / 1024 for v in it.reserved_mb], color="#8c8c8c", linewidth=1,
                label="reserved" if first else None)
        ax.plot(times, [v / 1024 for v in it.allocated_mb], color="#4c72b0", linewidth=1.2,
                label="allocated" if first else None)
    peak_time = r.number("peak_time_s")
    if peak_time is not None:
        ax.plot([peak_time], [r.number("peak_allocated_MB") / 1024], "v", color="red",
                label="peak allocated")
    ax.set_xlabel("Simulated time (s)")
    ax.set_ylabel("Memory (GiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title(r)}: memory over time", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return fig
