"""memsim heatmap: the peak memory of a TP x PP sweep as one publication-style heatmap.

Inputs are a sweep's memory traces, whose names carry the layout
(memory_trace_rank{R}_wd{W}_tp{T}_pp{P}_dp{D}_..._ts{S}.json), and its logs,
successful_configs.log and failed_configs.log, one "Config K: TP=.., PP=.., ... -
SUCCESS|FAILED (reason)" line per layout. A layout's peak is its worst rank's: that
rank decides whether the layout fits.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, Normalize
from matplotlib.patches import Patch, Rectangle

from common import (CommandParser, InputError, Output, command_parser, existing_dir,
                    positive)
from traces import TRACE_GLOB, load_trace, trace_files

DESCRIPTION = """\
Draw the peak memory of a TP x PP sweep as a heatmap (writes OUTPUT.png and OUTPUT.pdf).

Successful layouts are coloured white to red by peak / --max-memory and labelled with
the measured (Actual) and theoretical (Theory) peak; failed layouts are grey, with the
predicted peak when the failure reason or a trace gives one; hatching marks layouts
that succeeded although theory predicted >= --max-memory. GiB = MiB / 1024."""

LOGS = ("successful_configs.log", "failed_configs.log")
DEEP_RED = (214 / 255, 39 / 255, 40 / 255)
FAILED_GREY = "#e3e3e3"
MUTED_TEXT = "#6f6f6f"
MB_PER_GB = 1024.0

_LAYOUT_NAME = re.compile(
    r"^memory_trace_rank\d+_wd\d+_tp(?P<tp>\d+)_pp(?P<pp>\d+)_dp\d+_.*\.json$")
_LOG_LINE = re.compile(r"^Config\s+[^:]*:\s*TP=(?P<tp>\d+),\s*PP=(?P<pp>\d+)\b.*?\s-\s*"
                       r"(?P<status>SUCCESS|FAILED)\b\s*(?:\((?P<reason>.*)\))?\s*$")
_REASON_PEAK = re.compile(r"\bpeak\s+(?P<mb>\d+(?:\.\d+)?)\s*MB", re.IGNORECASE)
# memsim sweep --prune: "pruned (not simulated): parameters, ... alone take X MB on stage ..."
_REASON_PRUNED = re.compile(r"^pruned\b.*?\btake\s+(?P<mb>\d+(?:\.\d+)?)\s*MB")


@dataclass
class Cell:
    """What is known about one (TP, PP) layout."""

    succeeded: bool | None = None  # None: no log line
    peak_mb: float | None = None  # worst rank's peak over all iterations, from traces
    theory_mb: float | None = None
    reason_peak_mb: float | None = None  # "peak X MB" in a failure reason
    setup_mb: float | None = None  # pruned by memsim sweep --prune: its setup alone, in MB

    @property
    def failed(self) -> bool:
        """A layout failed when the logs say so; one with a trace but no log line ran."""
        return self.succeeded is False

    @property
    def predicted_mb(self) -> float | None:
        """The peak to show on a failed cell: the reason's, else the trace's."""
        return self.reason_peak_mb if self.reason_peak_mb is not None else self.peak_mb


Grid = dict[tuple[int, int], Cell]


def parser() -> CommandParser:
    """Options of the seed visualize_memory_heatmap.py, plus --dpi for the PNG."""
    p = command_parser("heatmap", DESCRIPTION)
    p.add_argument("--memory-dir", type=Path, required=True,
                   help=f"folder with the sweep's {TRACE_GLOB} files")
    p.add_argument("--log-dir", type=Path, required=True,
                   help="folder with successful_configs.log and/or failed_configs.log")
    p.add_argument("--output", type=Path, required=True,
                   help="output path without extension (writes OUTPUT.png, OUTPUT.pdf)")
    p.add_argument("--figsize", type=positive, nargs=2, metavar=("W", "H"),
                   help="figure size in inches (default: width max(6, 1.6 x #PP), "
                        "height width/3)")
    p.add_argument("--max-memory", type=positive, default=80.0,
                   help="GPU memory in GiB that maps to the deepest red (default: 80)")
    p.add_argument("--dpi", type=positive, default=300, help="PNG resolution (default: 300)")
    return p


# A readable heatmap has a few dozen columns and rows; hundreds take minutes and gigabytes
# to draw and show nothing.
MAX_GRID_VALUES = 64


def run(args: argparse.Namespace) -> None:
    """Reads the traces and logs, then writes both figures or neither."""
    grid = read_traces(args.memory_dir)
    read_logs(args.log_dir, grid)
    for axis, values in (("TP", {tp for tp, _ in grid}), ("PP", {pp for _, pp in grid})):
        if len(values) > MAX_GRID_VALUES:
            raise InputError(f"{args.memory_dir}: {len(values)} {axis} values, more than the "
                             f"{MAX_GRID_VALUES} a heatmap can show; plot a subset of the sweep")
    with Output() as out, plt.rc_context(ACADEMIC_STYLE):
        out.save_figure(heatmap_figure(grid, args.max_memory, args.figsize), args.dpi,
                        *(Path(f"{args.output}{suffix}") for suffix in (".png", ".pdf")))
    for layout in sorted(grid):
        print(cell_line(layout, grid[layout]))
    print(f"Wrote {args.output}.png and {args.output}.pdf")


def read_traces(folder: Path) -> Grid:
    """Per layout, the worst rank's peak and theoretical memory over all iterations."""
    existing_dir(folder, "memory folder", f"pass --memory-dir the folder with {TRACE_GLOB}")
    grid: Grid = {}
    for path in trace_files(folder, "pass --memory-dir the sweep's trace folder"):
        match = _LAYOUT_NAME.match(path.name)
        if not match:
            raise InputError(f"{path}: the name carries no layout; heatmap needs sweep traces "
                             "named memory_trace_rank{R}_wd{W}_tp{T}_pp{P}_dp{D}_..._ts{S}.json")
        cell = grid.setdefault((int(match["tp"]), int(match["pp"])), Cell())
        iterations = load_trace(path)
        cell.peak_mb = _max(cell.peak_mb, max(it.peak_allocated_mb for it in iterations))
        for it in iterations:
            cell.theory_mb = _max(cell.theory_mb, it.theoretical_mb)
    return grid


def _max(a: float | None, b: float | None) -> float | None:
    """max() where None means unknown."""
    return b if a is None else a if b is None else max(a, b)


def read_logs(folder: Path, grid: Grid) -> None:
    """Marks each logged layout successful or failed; one log may be missing or empty.

    Lines not starting with "Config" (headers, blank lines) are skipped. A layout logged
    both ways (a retry) counts as successful: it did run.
    """
    existing_dir(folder, "log folder", f"pass --log-dir the folder with {' and/or '.join(LOGS)}")
    logged = 0
    for name in LOGS:
        path = folder / name
        if not path.is_file():
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: cannot read ({e})") from None
        for number, line in enumerate(lines, start=1):
            if line.strip().startswith("Config"):
                _log_line(line.strip(), f"{path}:{number}", grid)
                logged += 1
    if not logged:
        raise InputError(f"no 'Config K: TP=.., PP=.. - SUCCESS|FAILED' lines in "
                         f"{' or '.join(str(folder / n) for n in LOGS)}; point --log-dir "
                         "at the sweep's log folder")


def _log_line(line: str, where: str, grid: Grid) -> None:
    """Applies one log line to the grid."""
    match = _LOG_LINE.match(line)
    if not match:
        raise InputError(f"{where}: cannot parse {line!r}; expected 'Config K: TP=T, PP=P, "
                         "DP=D, ... - SUCCESS' or '... - FAILED (reason)'")
    cell = grid.setdefault((int(match["tp"]), int(match["pp"])), Cell())
    if match["status"] == "SUCCESS":
        cell.succeeded = True
        return
    if cell.succeeded is None:
        cell.succeeded = False
    peak = _REASON_PEAK.search(match["reason"] or "")
    if peak:
        cell.reason_peak_mb = float(peak["mb"])
    pruned = _REASON_PRUNED.search(match["reason"] or "")
    if pruned:
        cell.setup_mb = float(pruned["mb"])


def cell_line(layout: tuple[int, int], cell: Cell) -> str:
    """One layout as text: what the cell shows, for the terminal."""
    tp, pp = layout
    if cell.failed:
        shown = [("predicted peak", cell.predicted_mb), ("pruned: setup alone", cell.setup_mb)]
    else:
        shown = [("peak", cell.peak_mb), ("theory", cell.theory_mb)]
    values = "".join(f", {name} {mb / MB_PER_GB:.1f} GiB" for name, mb in shown if mb is not None)
    return f"TP={tp} PP={pp}: {'failed' if cell.failed else 'successful'}{values}"


ACADEMIC_STYLE = {
    "font.family": "serif",
    "mathtext.fontset": "dejavuserif",
    "font.size": 9,
    "axes.labelsize": 10,
    "axes.linewidth": 0.6,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 8,
    "hatch.linewidth": 1.0,
}


def default_figsize(num_pp: int) -> tuple[float, float]:
    """The seed's 1:3 height:width ratio, wide enough for the cell labels."""
    width = max(6.0, 1.6 * num_pp)
    return width, width / 3


def heatmap_figure(grid: Grid, max_memory_gb: float,
                   figsize: tuple[float, float] | None) -> plt.Figure:
    """TP rows (ascending downwards) by PP columns (ascending rightwards)."""
    tps = sorted({tp for tp, _ in grid})
    pps = sorted({pp for _, pp in grid})
    width, height = figsize or default_figsize(len(pps))
    fig, ax = plt.subplots(figsize=(width, height))
    cmap = LinearSegmentedColormap.from_list("memsim_reds", ["white", DEEP_RED])
    norm = Normalize(vmin=0.0, vmax=max_memory_gb, clip=True)
    fontsize = _label_fontsize(width / len(pps), height / len(tps))
    for (tp, pp), cell in grid.items():
        _draw_cell(ax, (pps.index(pp), tps.index(tp)), cell, cmap, norm, fontsize)
    ax.set_xlim(-0.5, len(pps) - 0.5)
    ax.set_ylim(len(tps) - 0.5, -0.5)
    ax.set_xticks(range(len(pps)), [str(pp) for pp in pps])
    ax.set_yticks(range(len(tps)), [str(tp) for tp in tps])
    ax.tick_params(length=0)
    ax.set_xlabel("Pipeline-parallel size (PP)")
    ax.set_ylabel("Tensor-parallel size (TP)")
    colorbar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.015,
                            fraction=0.04)
    colorbar.set_label("Peak memory (GiB)")
    colorbar.outline.set_linewidth(0.5)
    ax.legend(handles=_legend_handles(cmap, max_memory_gb), loc="lower center",
              bbox_to_anchor=(0.5, 1.01), ncol=3, frameon=False, handlelength=1.6)
    return fig


def _label_fontsize(cell_width_in: float, cell_height_in: float) -> float:
    """Cell labels as large as fit two lines of ~14 characters, 4 to 9 points."""
    return max(4.0, min(9.0, cell_width_in * 72 / 11, cell_height_in * 72 / 4))


def _draw_cell(ax: plt.Axes, xy: tuple[int, int], cell: Cell, cmap: LinearSegmentedColormap,
               norm: Normalize, fontsize: float) -> None:
    """One layout: colour by peak, labels, grey when failed, hatch when theory says OOM."""
    x, y = xy
    corner = (x - 0.5, y - 0.5)
    if cell.failed:
        ax.add_patch(Rectangle(corner, 1, 1, facecolor=FAILED_GREY, edgecolor="white", lw=1.5))
        ax.text(x, y, "\u2014", ha="center", va="center", color=MUTED_TEXT, fontsize=fontsize + 2)
        if cell.predicted_mb is not None:
            ax.text(x, y + 0.3, f"pred. {cell.predicted_mb / MB_PER_GB:.1f} GiB", ha="center",
                    va="center", color=MUTED_TEXT, fontsize=fontsize * 0.8)
        elif cell.setup_mb is not None:
            ax.text(x, y + 0.3, f"setup {cell.setup_mb / MB_PER_GB:.1f} GiB (pruned)",
                    ha="center", va="center", color=MUTED_TEXT, fontsize=fontsize * 0.8)
        return
    if cell.peak_mb is None:
        ax.add_patch(Rectangle(corner, 1, 1, facecolor="white", edgecolor="#cccccc", lw=0.8))
        ax.text(x, y, "no trace", ha="center", va="center", color=MUTED_TEXT,
                fontsize=fontsize * 0.8)
        return
    peak_gb = cell.peak_mb / MB_PER_GB
    colour = cmap(norm(peak_gb))
    ax.add_patch(Rectangle(corner, 1, 1, facecolor=colour, edgecolor="white", lw=1.5))
    lines = [f"Actual: {peak_gb:.1f} GiB"]
    backdrop = None
    if cell.theory_mb is not None:
        lines.append(f"Theory: {cell.theory_mb / MB_PER_GB:.1f} GiB")
        if cell.theory_mb / MB_PER_GB >= norm.vmax:
            ax.add_patch(Rectangle(corner, 1, 1, fill=False, hatch="///", edgecolor="white",
                                   lw=0))
            backdrop = {"boxstyle": "round,pad=0.2", "facecolor": colour, "edgecolor": "none"}
    ax.text(x, y, "\n".join(lines), ha="center", va="center", fontsize=fontsize,
            color="white" if norm(peak_gb) > 0.6 else "black", linespacing=1.3,
            bbox=backdrop)  # the backdrop keeps the labels readable on the hatching


def _legend_handles(cmap: LinearSegmentedColormap, max_memory_gb: float) -> list[Patch]:
    """Successful, failed and theory >= max, drawn the way the cells are."""
    return [
        Patch(facecolor=cmap(0.7), edgecolor="none", label="Successful"),
        Patch(facecolor=FAILED_GREY, edgecolor="none", label="Failed / OOM"),
        Patch(facecolor=cmap(0.7), edgecolor="white", hatch="///",
              label=f"Theory \u2265 {max_memory_gb:g} GiB"),
    ]
