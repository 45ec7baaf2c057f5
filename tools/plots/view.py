"""memsim view: one self-contained HTML page of a memsim output folder.

The page needs no network and no server: its script (view.js), style (view.css) and data
are inlined, so it opens from file:// anywhere and can be mailed. Per rank class: the
timeline of the last iteration (allocated and reserved; phases shaded; the pointer shows
what was allocated or freed then; drag to zoom, double-click for the whole iteration,
report.html#zoom=FROM,TO opens at seconds FROM to TO), memory at the peak by category and
by module (layers of a stack merged, expandable) and the tensors alive at the peak (a
sortable table). For a sweep or a plan folder: its TP x PP heatmap and the layouts
(sortable).
"""

from __future__ import annotations

import argparse
import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from common import (CommandParser, InputError, Output, command_parser, existing_dir, is_number,
                    load_json)
from report import SUMMARY, RankReport, in_phase_order, load_report, module_pattern
from snapshot import bounded_memory, read_snapshot_pickle

DESCRIPTION = """\
Write one self-contained HTML page (no network: script and data inlined) of a memsim output
folder: what memsim simulate wrote (summary_rank{R}.json, memory_trace_rank{R}.json and
snapshot_rank{R}.pickle), a sweep's --out (sweep_results.json) or a plan's (plan.json).

The timeline shows the last iteration of each rank class; its phases and the allocations
under the pointer come from snapshot_rank{R}.pickle (the 20,000 largest allocator events
of the iteration are kept for the pointer when there are more). Drag across a timeline to
zoom into a stretch of time, double-click to see all of it again; report.html#zoom=FROM,TO
opens every timeline at seconds FROM to TO of its iteration."""

HERE = Path(__file__).resolve().parent
MAX_EVENTS = 20000  # allocator events kept for the pointer; the largest when there are more


def parser() -> CommandParser:
    p = command_parser("view", DESCRIPTION)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="a memsim simulate, sweep or plan output folder")
    p.add_argument("-o", "--output", type=Path,
                   help="the HTML file to write (default: RUN_DIR/report.html)")
    return p


def run(args: argparse.Namespace) -> None:
    data = page_data(args.run_dir)
    output = args.output or args.run_dir / "report.html"
    with Output() as out:
        out.write_text(output, page(data))
    print(f"Wrote {output} ({len(data['ranks'])} rank class(es)"
          f"{', a sweep' if data['sweep'] else ''}{', a plan' if data['plan'] else ''})")


def page_data(run_dir: Path) -> dict[str, Any]:
    """Everything the page shows, read and validated before anything is written."""
    existing_dir(run_dir, "run folder", "pass a folder memsim simulate, sweep or plan wrote")
    summaries = sorted((int(m[1]), p) for p in run_dir.iterdir() if (m := SUMMARY.match(p.name)))
    sweep_path, plan_path = run_dir / "sweep_results.json", run_dir / "plan.json"
    if not summaries and not sweep_path.is_file() and not plan_path.is_file():
        raise InputError(f"{run_dir} has no summary_rank{{R}}.json, sweep_results.json or "
                         "plan.json; pass the --out folder of memsim simulate, sweep or plan")
    ranks = [rank_data(load_report(rank, path), run_dir) for rank, path in summaries]
    plan = load_plan(plan_path) if plan_path.is_file() else None
    sweep = load_sweep(sweep_path) if sweep_path.is_file() else None
    gpu = ranks[0]["summary"].get("gpu", "") if ranks else ""
    kind = "plan" if plan else "sweep" if sweep else "run"
    title = f"memsim {kind}: {run_dir.resolve().name}"
    parts = [f"{len(ranks)} rank class(es)" + (f" on {gpu}" if gpu else "")] if ranks else []
    parts += [f"{len(sweep['layouts'])} sweep layouts"] if sweep else []
    parts += [f"{len(plan['layouts'])} plan layouts"] if plan else []
    subtitle = f"{run_dir}: " + ", ".join(parts)
    return {"title": title, "subtitle": subtitle, "ranks": ranks, "sweep": sweep, "plan": plan}


def rank_data(report: RankReport, run_dir: Path) -> dict[str, Any]:
    """One rank class: its summary, last iteration, phases and allocator events."""
    summary = report.summary
    timeline = None
    if report.trace:
        last = report.trace[-1]
        timeline = {"iteration": last.number,
                    "t": [last.start_s + t for t in last.times_s],
                    "allocated": last.allocated_mb, "reserved": last.reserved_mb}
    phases, events = snapshot_events(run_dir / f"snapshot_rank{report.rank}.pickle")
    return {
        "summary": summary,
        "timeline": timeline,
        "phases": phases,
        "phases_present": in_phase_order({p["phase"] for p in phases}, report.phase_order),
        "events": events,
        "module_groups": module_groups(summary.get("modules_at_peak", [])),
    }


def snapshot_events(path: Path) -> tuple[list[dict], list[dict]]:
    """(phase spans, allocator events) of the snapshot's trace; none without a snapshot.

    An allocation's second frame names the phase it was made in (Note [Snapshot frames] in
    simulator/snapshot_writer.h), so consecutive allocations of one phase make a span."""
    if not path.is_file():
        return [], []
    with bounded_memory(path):
        return _snapshot_events(read_snapshot_pickle(path))


def _snapshot_events(data: Any) -> tuple[list[dict], list[dict]]:
    traces = data.get("device_traces") if isinstance(data, dict) else None
    if not isinstance(traces, list) or not traces or not isinstance(traces[0], list):
        return [], []
    events, spans = [], []
    for entry in traces[0]:
        if not isinstance(entry, dict) or entry.get("action") not in ("alloc", "free_completed"):
            continue
        frames = entry.get("frames")
        if not isinstance(frames, list) or len(frames) < 3 or not all(
                isinstance(f, dict) for f in frames[:3]):
            continue  # not one of memsim's
        time_us, size = entry.get("time_us", 0), entry.get("size", 0)
        module, op, phase_frame, tensor = (frames[0].get("filename"), frames[0].get("name"),
                                           frames[1].get("name"), frames[2].get("name"))
        if not (is_number(time_us) and is_number(size)
                and all(isinstance(n, str) for n in (module, op, phase_frame, tensor))):
            continue  # not one of memsim's
        time_s = time_us / 1e6
        phase = phase_frame.split(" ", 1)[0]
        events.append({"t": time_s, "action": "alloc" if entry["action"] == "alloc" else "free",
                       "size_MB": size / 2**20, "module": module, "op": op, "tensor": tensor,
                       "phase": phase})
        if entry["action"] == "alloc":
            if spans and spans[-1]["phase"] == phase:
                spans[-1]["end"] = time_s
            else:
                if spans:
                    spans[-1]["end"] = time_s
                spans.append({"phase": phase, "start": time_s, "end": time_s})
    if spans and events:
        spans[-1]["end"] = events[-1]["t"]
    if len(events) > MAX_EVENTS:
        keep = sorted(range(len(events)), key=lambda i: -events[i]["size_MB"])[:MAX_EVENTS]
        events = [events[i] for i in sorted(keep)]
    return spans, events


def module_groups(modules: list[dict]) -> list[dict]:
    """The modules at the peak, the layers of a stack merged: decoder.layers.*.mlp holds
    every decoder.layers.N.mlp, largest group first."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for entry in modules:
        groups[module_pattern(entry["module"])].append(entry)
    merged = [{"module": name, "MB": sum(m["MB"] for m in members),
               "members": sorted(members, key=lambda m: -m["MB"])}
              for name, members in groups.items()]
    return sorted(merged, key=lambda g: -g["MB"])


def load_sweep(path: Path) -> dict[str, Any]:
    """sweep_results.json's layouts, each with its worst stage's peak allocated memory."""
    records = load_json(path)
    if not isinstance(records, list):
        raise InputError(f"{path}: expected a list of layouts; rerun memsim sweep")
    layouts = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("tp"), int) \
                or not isinstance(record.get("pp"), int):
            raise InputError(f"{path}: layout {i} has no integer tp and pp; rerun memsim sweep")
        stages = record.get("stages") or []
        peaks = [s.get("peak_allocated_MB") for s in stages if isinstance(s, dict)]
        peaks = [p for p in peaks if isinstance(p, (int, float))]
        layouts.append({**{k: v for k, v in record.items() if k != "stages"},
                        "peak_MB": max(peaks) if peaks else None})
    return {"layouts": layouts}


def load_plan(path: Path) -> dict[str, Any]:
    plan = load_json(path)
    if not isinstance(plan, dict) or not isinstance(plan.get("layouts"), list):
        raise InputError(f"{path}: expected memsim plan's plan.json with 'layouts'; rerun "
                         "memsim plan")
    for key in ("run", "world_size", "usable_GiB"):
        if key not in plan:
            raise InputError(f"{path}: missing '{key}'; rerun memsim plan")
    return plan


def page(data: dict[str, Any]) -> str:
    """The HTML page: style, data and script inlined."""
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False)
    payload = payload.replace("</", "<\\/")  # no "</script>" inside the data block
    style = (HERE / "view.css").read_text(encoding="utf-8")
    script = (HERE / "view.js").read_text(encoding="utf-8")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(data["title"])}</title>
<style>
{style}</style>
</head>
<body>
<div id="report"></div>
<script id="memsim-data" type="application/json">{payload}</script>
<script>
{script}</script>
</body>
</html>
"""
