"""memsim heatmap: the peak memory of a TP x PP sweep as one publication-style heatmap.

Inputs are a sweep's memory traces, whose names carry the layout
(memory_trace_rank{R}_wd{W}_tp{T}_pp{P}_dp{D}_..._ts{S}.json), and its logs,
successful_configs.log and failed_configs.log, one "Config K: TP=.., PP=.., ... -
SUCCESS|FAILED (reason)" line per layout. A layout's peak is its worst rank's: that
rank decides whether the layout fits. Every cell shows the same quantity, memsim's peak
allocated memory from the traces; a failed layout without a trace shows what its log
line says, named as such.
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
                    load_json, positive)
from traces import TRACE_GLOB, load_trace, trace_files

DESCRIPTION = """\
Draw the peak memory of a TP x PP sweep as a heatmap (writes OUTPUT.png and OUTPUT.pdf).

Successful layouts are coloured by peak / --max-memory and labelled with memsim's peak
allocated memory and the theoretical (Theory) peak; layouts predicted out of memory are
grey with memsim's peak; invalid layouts (a rule of the layout broken, e.g. TP not
dividing the attention heads) are crossed out, each rule as a footnote; hatching marks
layouts that fit although theory predicted >= --max-memory. GiB = MiB / 1024.

The title names the model, GPU and world size when the sweep's sweep_results.json is in
--log-dir (memsim sweep writes it there), else the world size from the trace names.
--style seed draws the seed tool's look (serif, white to red); clean a sans-serif one."""

LOGS = ("successful_configs.log", "failed_configs.log")
DEEP_RED = (214 / 255, 39 / 255, 40 / 255)
FAILED_GREY = "#e3e3e3"
MUTED_TEXT = "#6f6f6f"
MB_PER_GB = 1024.0

_LAYOUT_NAME = re.compile(
    r"^memory_trace_rank\d+_wd(?P<world>\d+)_tp(?P<tp>\d+)_pp(?P<pp>\d+)_dp\d+_.*\.json$")
_LOG_LINE = re.compile(r"^Config\s+[^:]*:\s*TP=(?P<tp>\d+),\s*PP=(?P<pp>\d+)\b.*?\s-\s*"
                       r"(?P<status>SUCCESS|FAILED)\b\s*(?:\((?P<reason>.*)\))?\s*$")
_REASON_PEAK = re.compile(r"\bpeak\s+(?P<mb>\d+(?:\.\d+)?)\s*MB", re.IGNORECASE)
# memsim sweep --prune: "pruned (not simulated): parameters, ... alone take X MB on stage ..."
_REASON_PRUNED = re.compile(r"^pruned\b.*?\btake\s+(?P<mb>\d+(?:\.\d+)?)\s*MB")
# memsim sweep: "invalid layout: <the rule the layout breaks>"
_REASON_INVALID = re.compile(r"^invalid layout:\s*(?P<rule>.*)$")
# sweep_results.json's "run": "<model> L.. H.. V.. E.. on <world>x<gpu> <precision> ..."
_RUN = re.compile(r"^(?P<model>\S+) .*? on (?P<world>\d+)x(?P<gpu>\S+)")


@dataclass
class Cell:
    """What is known about one (TP, PP) layout."""

    succeeded: bool | None = None  # None: no log line
    peak_mb: float | None = None  # worst rank's peak over all iterations, from traces
    theory_mb: float | None = None
    reason_peak_mb: float | None = None  # "peak X MB" in a failure reason (reserved)
    setup_mb: float | None = None  # pruned by memsim sweep --prune: its setup alone, in MB
    invalid_rule: str | None = None  # the layout rule it breaks: never simulated

    @property
    def failed(self) -> bool:
        """A layout failed when the logs say so; one with a trace but no log line ran."""
        return self.succeeded is False


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
    p.add_argument("--title", help="the figure's title (default: model, GPU and world size)")
    p.add_argument("--style", choices=sorted(STYLES), default="seed",
                   help="seed: the seed tool's serif, white-to-red look; clean: sans-serif "
                        "(default: seed)")
    return p


# A readable heatmap has a few dozen columns and rows; hundreds take minutes and gigabytes
# to draw and show nothing.
MAX_GRID_VALUES = 64


def run(args: argparse.Namespace) -> None:
    """Reads the traces and logs, then writes both figures or neither."""
    grid, worlds = read_traces(args.memory_dir)
    read_logs(args.log_dir, grid)
    title = args.title if args.title is not None else default_title(args.log_dir, worlds)
    for axis, values in (("TP", {tp for tp, _ in grid}), ("PP", {pp for _, pp in grid})):
        if len(values) > MAX_GRID_VALUES:
            raise InputError(f"{args.memory_dir}: {len(values)} {axis} values, more than the "
                             f"{MAX_GRID_VALUES} a heatmap can show; plot a subset of the sweep")
    style = STYLES[args.style]
    with Output() as out, plt.rc_context(style.rc):
        out.save_figure(heatmap_figure(grid, args.max_memory, args.figsize, title, style),
                        args.dpi,
                        *(Path(f"{args.output}{suffix}") for suffix in (".png", ".pdf")))
    for layout in sorted(grid):
        print(cell_line(layout, grid[layout]))
    print(f"Wrote {args.output}.png and {args.output}.pdf")


def read_traces(folder: Path) -> tuple[Grid, set[int]]:
    """Per layout, the worst rank's peak and theoretical memory over all iterations; and
    the world sizes the trace names carry."""
    existing_dir(folder, "memory folder", f"pass --memory-dir the folder with {TRACE_GLOB}")
    grid: Grid = {}
    worlds: set[int] = set()
    for path in trace_files(folder, "pass --memory-dir the sweep's trace folder"):
        match = _LAYOUT_NAME.match(path.name)
        if not match:
            raise InputError(f"{path}: the name carries no layout; heatmap needs sweep traces "
                             "named memory_trace_rank{R}_wd{W}_tp{T}_pp{P}_dp{D}_..._ts{S}.json")
        worlds.add(int(match["world"]))
        cell = grid.setdefault((int(match["tp"]), int(match["pp"])), Cell())
        iterations = load_trace(path)
        cell.peak_mb = _max(cell.peak_mb, max(it.peak_allocated_mb for it in iterations))
        for it in iterations:
            cell.theory_mb = _max(cell.theory_mb, it.theoretical_mb)
    return grid, worlds


def default_title(log_dir: Path, worlds: set[int]) -> str:
    """"<model> on <world> x <gpu>" from the sweep's sweep_results.json, else the world
    size from the trace names."""
    results = log_dir / "sweep_results.json"
    if results.is_file():
        records = load_json(results)
        runs = {r.get("run") for r in records if isinstance(r, dict)} \
            if isinstance(records, list) else set()
        matches = [_RUN.match(run) for run in runs if isinstance(run, str)]
        if len(matches) == 1 and matches[0]:
            m = matches[0]
            return f"{m['model']} on {int(m['world']):,} \u00d7 {m['gpu']}"
    if len(worlds) == 1:
        return f"TP \u00d7 PP sweep on {next(iter(worlds)):,} GPUs"
    return "TP \u00d7 PP sweep"


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
    reason = match["reason"] or ""
    peak = _REASON_PEAK.search(reason)
    if peak:
        cell.reason_peak_mb = float(peak["mb"])
    pruned = _REASON_PRUNED.search(reason)
    if pruned:
        cell.setup_mb = float(pruned["mb"])
    invalid = _REASON_INVALID.match(reason)
    if invalid:
        cell.invalid_rule = invalid["rule"].strip() or "no rule given"


def cell_line(layout: tuple[int, int], cell: Cell) -> str:
    """One layout as text: what the cell shows, for the terminal."""
    tp, pp = layout
    if cell.invalid_rule is not None:
        return f"TP={tp} PP={pp}: invalid ({cell.invalid_rule})"
    if cell.failed:
        shown = [("memsim peak", cell.peak_mb), ("pruned: setup alone", cell.setup_mb)]
        if cell.peak_mb is None:
            shown.append(("log: peak reserved", cell.reason_peak_mb))
    else:
        shown = [("peak", cell.peak_mb), ("theory", cell.theory_mb)]
    values = "".join(f", {name} {mb / MB_PER_GB:.1f} GiB" for name, mb in shown if mb is not None)
    return f"TP={tp} PP={pp}: {'failed' if cell.failed else 'successful'}{values}"


@dataclass(frozen=True)
class Style:
    """A look: matplotlib settings and the colours of cells by peak."""

    rc: dict
    colours: tuple[str | tuple[float, float, float], ...]  # low to high peak


_COMMON_RC = {"font.size": 9, "axes.labelsize": 10, "axes.linewidth": 0.6,
              "xtick.labelsize": 9, "ytick.labelsize": 9, "legend.fontsize": 8,
              "hatch.linewidth": 1.0}
STYLES = {
    "seed": Style({**_COMMON_RC, "font.family": "serif", "mathtext.fontset": "dejavuserif"},
                  ("white", DEEP_RED)),
    "clean": Style({**_COMMON_RC, "font.family": "sans-serif"},
                   ("#f7fbff", "#6baed6", "#08306b")),
}
INVALID_HATCH = "xx"


def default_figsize(num_pp: int) -> tuple[float, float]:
    """The seed's 1:3 height:width ratio, wide enough for the cell labels."""
    width = max(6.0, 1.6 * num_pp)
    return width, width / 3


def invalid_rules(grid: Grid) -> list[str]:
    """The distinct rules invalid layouts break, in layout order: footnote i is rules[i]."""
    rules: list[str] = []
    for layout in sorted(grid):
        rule = grid[layout].invalid_rule
        if rule is not None and rule not in rules:
            rules.append(rule)
    return rules


def heatmap_figure(grid: Grid, max_memory_gb: float, figsize: tuple[float, float] | None,
                   title: str, style: Style) -> plt.Figure:
    """TP rows (ascending downwards) by PP columns (ascending rightwards), invalid
    layouts' rules as footnotes below."""
    tps = sorted({tp for tp, _ in grid})
    pps = sorted({pp for _, pp in grid})
    width, height = figsize or default_figsize(len(pps))
    fig, ax = plt.subplots(figsize=(width, height))
    cmap = LinearSegmentedColormap.from_list(f"memsim_{id(style)}", list(style.colours))
    norm = Normalize(vmin=0.0, vmax=max_memory_gb, clip=True)
    fontsize = _label_fontsize(width / len(pps), height / len(tps))
    rules = invalid_rules(grid)
    for (tp, pp), cell in grid.items():
        xy = (pps.index(pp), tps.index(tp))
        if cell.invalid_rule is not None:
            _draw_invalid(ax, xy, _footnote_mark(rules.index(cell.invalid_rule)), fontsize)
        else:
            _draw_cell(ax, xy, cell, cmap, norm, fontsize)
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
    ax.legend(handles=_legend_handles(cmap, max_memory_gb, bool(rules)), loc="lower center",
              bbox_to_anchor=(0.5, 1.01), ncol=4, frameon=False, handlelength=1.6)
    fig.suptitle(title, fontsize=11, y=1.0, va="bottom")
    if rules:
        notes = [f"{_footnote_mark(i)} invalid: {rule}" for i, rule in enumerate(rules)]
        # Below the tick labels and the axis label (about 35 points under the axes).
        ax.annotate("\n".join(notes), (0.0, 0.0), xycoords="axes fraction", xytext=(0, -36),
                    textcoords="offset points", ha="left", va="top", fontsize=7,
                    color=MUTED_TEXT)
    return fig


def _footnote_mark(index: int) -> str:
    """a, b, ..., z, aa, ab, ...: the footnote of the index-th invalid rule."""
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("a") + rest) + letters
    return letters


def _draw_invalid(ax: plt.Axes, xy: tuple[int, int], mark: str, fontsize: float) -> None:
    """An invalid layout: crossed out on white, never simulated, its rule's footnote."""
    x, y = xy
    ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor="white", edgecolor="#bdbdbd",
                           hatch=INVALID_HATCH, lw=0.8))
    ax.text(x, y, f"invalid ({mark})", ha="center", va="center", color=MUTED_TEXT,
            fontsize=fontsize * 0.9,
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none"})


def _label_fontsize(cell_width_in: float, cell_height_in: float) -> float:
    """Cell labels as large as fit two lines of ~18 characters, 4 to 9 points."""
    return max(4.0, min(9.0, cell_width_in * 72 / 15, cell_height_in * 72 / 4))


def _draw_cell(ax: plt.Axes, xy: tuple[int, int], cell: Cell, cmap: LinearSegmentedColormap,
               norm: Normalize, fontsize: float) -> None:
    """One layout: colour by peak, labels, grey when failed, hatch when theory says OOM."""
    x, y = xy
    corner = (x - 0.5, y - 0.5)
    if cell.failed:
        ax.add_patch(Rectangle(corner, 1, 1, facecolor=FAILED_GREY, edgecolor="white", lw=1.5))
        ax.text(x, y, "\u2014", ha="center", va="center", color=MUTED_TEXT, fontsize=fontsize + 2)
        if cell.peak_mb is not None:  # the same quantity as the cells that fit
            ax.text(x, y + 0.3, f"memsim: {cell.peak_mb / MB_PER_GB:.1f} GiB", ha="center",
                    va="center", color=MUTED_TEXT, fontsize=fontsize * 0.8)
        elif cell.reason_peak_mb is not None:  # a log without traces: say what it is
            ax.text(x, y + 0.3, f"log: {cell.reason_peak_mb / MB_PER_GB:.1f} GiB reserved",
                    ha="center", va="center", color=MUTED_TEXT, fontsize=fontsize * 0.8)
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
    lines = [f"memsim: {peak_gb:.1f} GiB"]
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


def _legend_handles(cmap: LinearSegmentedColormap, max_memory_gb: float,
                    any_invalid: bool) -> list[Patch]:
    """Fits, out of memory, theory >= max and (when drawn) invalid, as the cells look."""
    handles = [
        Patch(facecolor=cmap(0.7), edgecolor="none", label="Fits"),
        Patch(facecolor=FAILED_GREY, edgecolor="none", label="Out of memory / failed"),
        Patch(facecolor=cmap(0.7), edgecolor="white", hatch="///",
              label=f"Theory \u2265 {max_memory_gb:g} GiB"),
    ]
    if any_invalid:
        handles.append(Patch(facecolor="white", edgecolor="#bdbdbd", hatch=INVALID_HATCH,
                             label="Invalid layout"))
    return handles
