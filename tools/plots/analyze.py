"""memsim analyze: what a PyTorch memory snapshot holds, and what to do about it.

Writes a timestamped run folder RESULTS_DIR/YYYYMMDD_HHMMSS_NAME (five figures,
analysis_report.txt, README.md) and points RESULTS_DIR/latest at it, like the seed
analyzer. The folder is assembled under a hidden name and renamed into place, so a
failed run leaves nothing behind and `latest` never points at a half-written folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from common import CommandParser, InputError, Output, command_parser, positive
from snapshot import MB, Allocation, Snapshot, allocations, bytes_by_category, load_snapshot

DESCRIPTION = """\
Analyze a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot, or memsim's
snapshot_rank{R}_peak.pickle, the allocator at the peak; its snapshot_rank{R}.pickle is
the state after the last step): efficiency, memory by category, the largest allocations,
fragmentation and recommendations.

Writes RESULTS_DIR/YYYYMMDD_HHMMSS_NAME/ with memory_overview.png, top_consumers.png,
category_breakdown.png, size_distribution.png, memory_efficiency.png,
analysis_report.txt and README.md, and points RESULTS_DIR/latest at it.
Categories are exact for memsim snapshots and keyword guesses from the stack otherwise."""

GB = 2**30
CACHE_OVERHEAD_PCT = 10.0  # more reserved-but-free than this is worth fixing
LARGE_FREE_BLOCK = 100 * MB  # a free block this large is memory another tensor could use;
# also the least memory a suspected leak must hold to be reported
REPEATS_FOR_LEAK = 10  # this many same-size allocations from one place look like a leak
SHORT_LIVED_CATEGORIES = {"Activations", "Temporaries", "Attention", "Linear/MatMul",
                          "Expert/MoE", "Unknown"}
CATEGORY_COLOURS = {
    "Parameters": "#1f77b4", "Gradients": "#ff7f0e", "Gradient": "#ff7f0e",
    "Optimizer State": "#2ca02c", "Activations": "#d62728", "Temporaries": "#9467bd",
    "Communication": "#8c564b", "Expert/MoE": "#e377c2", "Attention": "#17becf",
    "Linear/MatMul": "#bcbd22", "FSDP": "#7f7f7f", "Unknown": "#c7c7c7",
}


@dataclass(frozen=True)
class Analysis:
    """Everything the report, README and figures show, computed once."""

    snapshot: Snapshot
    allocs: list[Allocation]  # active blocks, largest first
    free_blocks: list[int]  # sizes of cached (inactive) blocks
    by_category: dict[str, int]
    # memsim's summary_rank{R}.json beside its snapshot_rank{R}.pickle, when there is one.
    companion: dict | None = None

    @property
    def out_of_memory(self) -> bool:
        """The run this snapshot is from ran out of memory."""
        return self.snapshot.saw_oom or bool(self.companion and "out_of_memory" in self.companion)

    @property
    def usable_bytes(self) -> int | None:
        """The GPU's usable memory, when the companion summary says."""
        usable = self.companion.get("gpu_usable_MB") if self.companion else None
        return int(usable * MB) if isinstance(usable, (int, float)) and usable > 0 else None

    @property
    def wasted(self) -> int:
        return self.snapshot.reserved - self.snapshot.allocated

    @property
    def rating(self) -> str:
        """The seed analyzer's bands: >98% excellent, 95-98% good, below poor."""
        pct = self.snapshot.efficiency_pct
        return "excellent" if pct > 98 else "good" if pct >= 95 else "poor"

    @property
    def recommendations(self) -> list[str]:
        return recommendations(self)


def parser() -> CommandParser:
    """The seed analyze.py's positional arguments, plus --dpi."""
    p = command_parser("analyze", DESCRIPTION)
    p.add_argument("snapshot", type=Path, metavar="SNAPSHOT", help="the snapshot pickle")
    p.add_argument("results_dir", type=Path, nargs="?", default=Path("results"),
                   metavar="RESULTS_DIR", help="where run folders go (default: results)")
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="run name (default: from the path, e.g. iteration_1/rank0_... -> "
                        "iter1_rank0, else the file name without extension)")
    p.add_argument("--dpi", type=positive, default=120, help="PNG resolution (default: 120)")
    return p


def run(args: argparse.Namespace) -> None:
    """Analyzes, writes the run folder under a hidden name, then publishes it."""
    analysis = analyze(load_snapshot(args.snapshot), companion_summary(args.snapshot))
    results = args.results_dir
    latest = results / "latest"
    if latest.exists() and not latest.is_symlink():
        raise InputError(f"{latest} exists and is not a symlink; move it away so analyze "
                         "can point it at the newest run")
    name = safe_name(args.name or default_name(args.snapshot))
    with Output() as out:
        staging = out.make_staging_dir(results)
        write_results(out, staging, analysis, name, args.dpi)
        out.commit()
        final = unique_dir(results, f"{datetime.now():%Y%m%d_%H%M%S}_{name}")
        os.rename(staging, final)
        point_symlink(latest, final.name)
    print(summary_text(analysis))
    print(f"\nWrote {final}/ ({latest} points at it)")


def default_name(snapshot: Path) -> str:
    """iter{N}_rank{R} for torchtitan's iteration_N/rankR_memory_snapshot.pickle."""
    iteration = re.fullmatch(r"iteration_(\d+)", snapshot.parent.name)
    rank = re.match(r"rank(\d+)", snapshot.stem)
    if iteration and rank:
        return f"iter{iteration[1]}_rank{rank[1]}"
    return snapshot.stem


def safe_name(name: str) -> str:
    """A name usable as one path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "snapshot"


def unique_dir(parent: Path, name: str) -> Path:
    """parent/name, or parent/name_2, ... when two runs start in the same second."""
    candidate, n = parent / name, 1
    while candidate.exists():
        n += 1
        candidate = parent / f"{name}_{n}"
    return candidate


def point_symlink(link: Path, target: str) -> None:
    """Points `link` at `target` (relative, so the results folder can move) atomically:
    a new link under a temporary name renamed over the old one."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def companion_summary(snapshot: Path) -> dict | None:
    """memsim's summary_rank{R}.json beside snapshot_rank{R}[_peak].pickle (its verdict,
    usable memory and measured advice), or None; one that cannot be read is an error."""
    rank = re.fullmatch(r"snapshot_rank(\d+)(?:_peak)?", snapshot.stem)
    path = snapshot.with_name(f"summary_rank{rank[1]}.json") if rank else None
    if path is None or not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise InputError(f"{path}: cannot read memsim's summary beside the snapshot ({e})") from None
    if not isinstance(summary, dict):
        raise InputError(f"{path}: not a memsim summary (expected a JSON object)")
    return summary


def analyze(snapshot: Snapshot, companion: dict | None = None) -> Analysis:
    """The numbers behind the report."""
    allocs = allocations(snapshot)
    free_blocks = sorted((b.size for b in snapshot.blocks if not b.active), reverse=True)
    return Analysis(snapshot, allocs, free_blocks, bytes_by_category(allocs), companion)


def recommendations(a: Analysis) -> list[str]:
    """Cache overhead, large idle blocks, empty segments and likely leaks; for a run that
    ran out of memory, that the peak itself must come down, and by which switch."""
    found = []
    if a.out_of_memory:
        found.append("This run ran out of memory. PyTorch already releases every cached block "
                     "and retries before it raises, so torch.cuda.empty_cache() cannot help: "
                     "the peak itself has to come down.")
        found.extend(_measured_advice(a.companion))
    reserved = a.snapshot.reserved
    overhead = a.wasted / reserved * 100
    if overhead > CACHE_OVERHEAD_PCT:
        expandable = all(s.expandable for s in a.snapshot.segments)
        remedy = ("The segments are already expandable: try fewer distinct tensor sizes."
                  if expandable else
                  "Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or fewer distinct "
                  "tensor sizes.")
        found.append(f"High cache overhead: {_gb(a.wasted)} ({overhead:.1f}% of reserved) is "
                     f"reserved but not allocated. {remedy}")
    large = [s for s in a.free_blocks if s >= LARGE_FREE_BLOCK]
    if large:
        found.append(f"{len(large)} cached free block(s) of 100 MiB or more hold "
                     f"{_gb(sum(large))} unused (largest {_mb(large[0])}); tensors that do "
                     "not fit them force new segments." +
                     ("" if a.out_of_memory else
                      " torch.cuda.empty_cache() returns whole free segments."))
    empty = [s for s in a.snapshot.segments if not any(b.active for b in s.blocks)]
    if empty and not a.out_of_memory:
        found.append(f"{len(empty)} segment(s) ({_gb(sum(s.total_size for s in empty))}) "
                     "hold no live allocation: torch.cuda.empty_cache() would release them.")
    found.extend(_repeated_allocations(a.allocs))
    found.extend(_late_survivors(a.allocs))
    return found


def _measured_advice(companion: dict | None) -> list[str]:
    """The switches memsim simulate --advise re-simulated, best first, or how to get them."""
    advice = companion.get("advice") if companion else None
    if not isinstance(advice, list) or not advice:
        return ["Run memsim simulate --advise on the configuration: it re-simulates each "
                "switch that could cut the peak (recomputation, SP, the distributed "
                "optimizer, more PP or TP, a smaller micro batch) and says by how much."]
    lines = []
    for entry in advice[:5]:
        if not isinstance(entry, dict):
            continue
        change, peak = entry.get("change"), entry.get("peak_reserved_MB")
        ratio, fits = entry.get("step_time_ratio"), entry.get("fits")
        if isinstance(change, str) and isinstance(peak, (int, float)) and \
                isinstance(ratio, (int, float)):
            lines.append(f"Measured by memsim: {change} gives a peak of {peak / 1024:,.2f} GiB "
                         f"({'fits' if fits else 'still does not fit'}), step time "
                         f"{(ratio - 1) * 100:+.1f}%.")
    return lines


def _repeated_allocations(allocs: list[Allocation]) -> list[str]:
    """Many same-size short-lived blocks from one place alive together, 100 MiB or more:
    one added per step is a leak. (Parameters, gradients and optimizer state come in
    many same-size tensors by design.)"""
    groups = Counter((a.label, a.size) for a in allocs if a.category in SHORT_LIVED_CATEGORIES)
    return [f"Possible leak: {count} allocations of {_mb(size)} from {where} are alive at "
            f"once ({_gb(count * size)}). Expected if they are per-layer or per-microbatch; "
            "a leak if one is added per step."
            for (where, size), count in groups.most_common()
            if count >= REPEATS_FOR_LEAK and count * size >= LARGE_FREE_BLOCK]


def _late_survivors(allocs: list[Allocation]) -> list[str]:
    """Short-lived tensors allocated in backward or the optimizer step that are alive."""
    found = []
    for phase in ("backward", "optimizer"):
        alive = [a for a in allocs if a.phase == phase and a.category in SHORT_LIVED_CATEGORIES]
        if alive:
            total = _gb(sum(a.size for a in alive))
            found.append(f"{len(alive)} {phase} allocation(s) that are not parameters, "
                         f"gradients or optimizer state are alive ({total}, largest: "
                         f"{alive[0].label}). Normal mid-step; a leak if the snapshot was "
                         "taken after optimizer.step().")
    return found


def _mb(n: int) -> str:
    return f"{n / MB:,.1f} MiB"


def _gb(n: int) -> str:
    return f"{n / GB:,.2f} GiB"


def summary_text(a: Analysis) -> str:
    """The headline numbers, for the terminal and the top of the report."""
    s = a.snapshot
    return "\n".join([
        f"Reserved:   {_gb(s.reserved)} ({s.reserved} bytes)",
        f"Allocated:  {_gb(s.allocated)} ({s.allocated} bytes)",
        f"Cache/fragmentation (reserved - allocated): {_gb(a.wasted)} ({a.wasted} bytes)",
        f"Cache efficiency (allocated / reserved): {s.efficiency_pct:.2f}% ({a.rating})",
        *([f"GPU use (reserved / usable): {s.reserved / a.usable_bytes * 100:.1f}% of "
           f"{_gb(a.usable_bytes)}"] if a.usable_bytes else []),
        *(["Out of memory: yes"] if a.out_of_memory else []),
    ])


def report_text(a: Analysis, name: str) -> str:
    """analysis_report.txt: efficiency, categories, top 50, fragmentation, advice."""
    s = a.snapshot
    source = ("memsim snapshot: exact categories" if s.exact
              else "PyTorch snapshot: categories guessed from stack keywords")
    lines = [f"Memory snapshot analysis: {name}", f"Snapshot: {s.path} ({source})",
             f"Segments: {len(s.segments)}; active blocks: {len(a.allocs)}; "
             f"free blocks: {len(a.free_blocks)}", "",
             "== Memory efficiency", summary_text(a), "", "== Memory by category",
             f"{'category':<18}{'MB':>14}{'% alloc':>10}{'blocks':>9}"]
    counts = Counter(x.category for x in a.allocs)
    for category, size in a.by_category.items():
        lines.append(f"{category:<18}{size / MB:>14,.1f}{size / s.allocated * 100:>9.1f}%"
                     f"{counts[category]:>9}")
    lines += ["", "== Largest allocations (top 50)",
              f"{'#':>3}{'MB':>12}  {'category':<16}{'phase':<11}where"]
    for i, x in enumerate(a.allocs[:50], start=1):
        lines.append(f"{i:>3}{x.size / MB:>12,.1f}  {x.category:<16}{x.phase or '-':<11}{x.label}")
    lines += ["", "== Fragmentation analysis", *fragmentation_lines(a), "", "== Recommendations"]
    lines += [f"- {r}" for r in a.recommendations] or ["- None: memory is used efficiently."]
    return "\n".join(lines) + "\n"


def fragmentation_lines(a: Analysis) -> list[str]:
    """Free-block statistics overall and per pool, and rounding inside allocations."""
    free = a.free_blocks
    total = sum(free)
    lines = [f"Cached free blocks: {len(free)}, {_mb(total)} in total"]
    if free:
        lines.append(f"Largest free block: {_mb(free[0])}; mean {_mb(total // len(free))}; "
                     f"fragmentation 1 - largest/total = {1 - free[0] / total:.2f}")
    lines.append(f"Rounding inside allocations (size - requested): "
                 f"{_mb(sum(x.size - x.requested for x in a.allocs))}")
    for pool in sorted({seg.segment_type for seg in a.snapshot.segments}):
        segs = [seg for seg in a.snapshot.segments if seg.segment_type == pool]
        reserved = sum(seg.total_size for seg in segs)
        allocated = sum(b.size for seg in segs for b in seg.blocks if b.active)
        lines.append(f"{pool} pool: {len(segs)} segments, reserved {_mb(reserved)}, "
                     f"allocated {_mb(allocated)}, free {_mb(reserved - allocated)}")
    return lines


def readme_text(a: Analysis, name: str) -> str:
    """README.md: the findings of this run at a glance."""
    s = a.snapshot
    lines = [f"# Memory snapshot analysis: {name}", "",
             f"Snapshot `{s.path}`, analyzed {datetime.now():%Y-%m-%d %H:%M:%S}.", "",
             "| | |", "| --- | --- |",
             f"| Reserved | {_gb(s.reserved)} |", f"| Allocated | {_gb(s.allocated)} |",
             f"| Cache/fragmentation | {_gb(a.wasted)} |",
             f"| Cache efficiency (allocated / reserved) | {s.efficiency_pct:.2f}% "
             f"({a.rating}) |", "",
             "## Where the memory goes", ""]
    lines += [f"- {c}: {_gb(n)} ({n / s.allocated * 100:.1f}%)"
              for c, n in list(a.by_category.items())[:6]] or ["- no live allocations"]
    lines += ["", "## Largest allocations", ""]
    lines += [f"{i}. {_mb(x.size)}, {x.category}: `{x.label}`"
              for i, x in enumerate(a.allocs[:5], start=1)] or ["none"]
    lines += ["", "## Findings", ""]
    lines += [f"- {r}" for r in a.recommendations] or ["- No issues found."]
    lines += ["", "## Files", "",
              "- `analysis_report.txt`: full report (top 50 allocations, fragmentation)",
              "- `memory_overview.png`, `top_consumers.png`, `category_breakdown.png`, "
              "`size_distribution.png`, `memory_efficiency.png`"]
    return "\n".join(lines) + "\n"


def write_results(out: Output, folder: Path, a: Analysis, name: str, dpi: float) -> None:
    """Every file of a run folder."""
    figures = {
        "memory_overview.png": overview_figure,
        "top_consumers.png": top_consumers_figure,
        "category_breakdown.png": category_figure,
        "size_distribution.png": size_distribution_figure,
        "memory_efficiency.png": efficiency_figure,
    }
    for filename, draw in figures.items():
        out.save_figure(draw(a), dpi, folder / filename)
    out.write_text(folder / "analysis_report.txt", report_text(a, name))
    out.write_text(folder / "README.md", readme_text(a, name))


def _colour(category: str) -> str:
    return CATEGORY_COLOURS.get(category, "#aec7e8")


def _no_data(ax: plt.Axes, text: str) -> None:
    """An explanation where a chart would be empty."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_axis_off()


def overview_figure(a: Analysis) -> plt.Figure:
    """Pies: allocated vs cached, and the allocated memory by category."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.5))
    left.pie([a.snapshot.allocated, a.wasted], colors=["#4c72b0", "#dd8452"],
             labels=[f"Allocated\n{_gb(a.snapshot.allocated)}",
                     f"Cache/fragmentation\n{_gb(a.wasted)}"],
             autopct="%1.1f%%", startangle=90, wedgeprops={"linewidth": 1, "edgecolor": "white"})
    left.set_title(f"Reserved memory: {_gb(a.snapshot.reserved)}")
    if a.by_category:
        sizes = list(a.by_category.values())
        right.pie(sizes, colors=[_colour(c) for c in a.by_category], startangle=90,
                  autopct=lambda pct: f"{pct:.1f}%" if pct >= 3 else "",
                  wedgeprops={"linewidth": 1, "edgecolor": "white"})
        right.legend([f"{c} ({_gb(n)})" for c, n in a.by_category.items()],
                     loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
        right.set_title("Allocated memory by category")
    else:
        _no_data(right, "no live allocations")
    return fig


def top_consumers_figure(a: Analysis) -> plt.Figure:
    """The 30 largest live allocations, coloured by category."""
    top = a.allocs[:30]
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.3 * len(top) + 1.5)))
    if not top:
        _no_data(ax, "no live allocations")
        return fig
    y = np.arange(len(top))
    ax.barh(y, [x.size / MB for x in top], color=[_colour(x.category) for x in top])
    ax.set_yticks(y, [_short(x.label) for x in top], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("Size (MiB)")
    ax.set_title(f"Top {len(top)} live allocations")
    ax.grid(True, axis="x", alpha=0.3)
    shown = dict.fromkeys(x.category for x in top)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_colour(c)) for c in shown],
              labels=list(shown), loc="lower right", fontsize=8)
    return fig


def _short(text: str, width: int = 70) -> str:
    """Long labels cut in the middle, keeping the module and the tensor shape."""
    return text if len(text) <= width else f"{text[:width // 2 - 2]}...{text[-(width // 2 - 1):]}"


def category_figure(a: Analysis) -> plt.Figure:
    """Allocated memory per category, with block counts."""
    fig, ax = plt.subplots(figsize=(10, 5))
    if not a.by_category:
        _no_data(ax, "no live allocations")
        return fig
    counts = Counter(x.category for x in a.allocs)
    names = list(a.by_category)
    sizes = [a.by_category[c] / GB for c in names]
    bars = ax.bar(names, sizes, color=[_colour(c) for c in names])
    for bar, c in zip(bars, names):
        ax.annotate(f"{a.by_category[c] / GB:.2f} GiB\n{counts[c]} blocks",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel("Allocated memory (GiB)")
    ax.set_title("Memory by category")
    ax.margins(y=0.18)
    ax.tick_params(axis="x", labelrotation=20)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def size_distribution_figure(a: Analysis) -> plt.Figure:
    """Histograms (log-spaced MB bins) of live allocations and of cached free blocks."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [([x.size for x in a.allocs], "Live allocations", "#4c72b0"),
              (a.free_blocks, "Cached free blocks", "#dd8452")]
    for ax, (sizes, title, colour) in zip(axes, series):
        if not sizes:
            _no_data(ax, f"no {title.lower()}")
            continue
        mb = np.array(sizes, dtype=float) / MB
        low, high = max(mb.min(), 1e-3), max(mb.max(), 1e-3)
        bins = np.geomspace(low, high * 1.01, 30) if high > low * 1.01 else 10
        ax.hist(np.clip(mb, low, None), bins=bins, color=colour, edgecolor="white")
        if high > low * 1.01:
            ax.set_xscale("log")
        ax.set_xlabel("Block size (MiB)")
        ax.set_ylabel("Blocks")
        ax.set_title(f"{title}: {len(sizes)} blocks, {_gb(sum(sizes))}")
        ax.grid(True, alpha=0.3)
    return fig


def efficiency_figure(a: Analysis) -> plt.Figure:
    """Reserved, allocated and wasted memory, and the efficiency as a filled bar."""
    s = a.snapshot
    fig, (bars_ax, gauge) = plt.subplots(1, 2, figsize=(12, 4.5),
                                         gridspec_kw={"width_ratios": [3, 2]})
    values = [s.reserved / GB, s.allocated / GB, a.wasted / GB]
    bars = bars_ax.bar(["Reserved", "Allocated", "Wasted"], values,
                       color=["#8c8c8c", "#4c72b0", "#dd8452"])
    for bar, value in zip(bars, values):
        bars_ax.annotate(f"{value:.2f} GiB", (bar.get_x() + bar.get_width() / 2, value),
                         ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    bars_ax.set_ylabel("Memory (GiB)")
    bars_ax.set_title("Reserved vs allocated")
    bars_ax.margins(y=0.12)
    pct = s.efficiency_pct
    gauge.barh([0], [pct], color="#4c72b0")
    gauge.barh([0], [100 - pct], left=[pct], color="#dd8452")
    gauge.text(50, 0, f"{pct:.1f}% of reserved allocated ({a.rating})", ha="center", va="center",
               color="white", fontsize=13, fontweight="bold")
    gauge.set_xlim(0, 100)
    gauge.set_yticks([])
    gauge.set_xlabel("% of reserved memory allocated")
    gauge.set_title("Cache efficiency (allocated / reserved)")
    return fig
