"""memsim plan's figures, from the plan.json it wrote: memory versus sequence length for
the best layout (with the GPU's usable memory) and the step time of the layouts that fit.
`memsim plan` runs this itself; run it again as `memsim plan-figures PLAN_DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt

from common import CommandParser, InputError, Output, command_parser, load_json, positive

DESCRIPTION = __doc__


def parser() -> CommandParser:
    p = command_parser("plan-figures", DESCRIPTION)
    p.add_argument("plan_dir", type=Path, metavar="PLAN_DIR", help="memsim plan's --out folder")
    p.add_argument("--dpi", type=positive, default=120, help="PNG resolution (default: 120)")
    return p


def run(args: argparse.Namespace) -> None:
    plan = load_json(args.plan_dir / "plan.json")
    curve, layouts, usable = _validated(plan, args.plan_dir / "plan.json")
    with Output() as out:
        if curve:
            out.save_figure(sequence_figure(curve, usable, plan["run"]), args.dpi,
                            args.plan_dir / "memory_vs_sequence_length.png")
        if layouts:
            out.save_figure(step_figure(layouts, plan["run"]), args.dpi,
                            args.plan_dir / "step_time.png")
        out.commit()


def _validated(plan: object, path: Path) -> tuple[list[dict], list[dict], float]:
    """The sequence curve, the layouts that fit (ranked), and the usable GiB."""
    if not isinstance(plan, dict) or not isinstance(plan.get("layouts"), list) or \
            not isinstance(plan.get("run"), str):
        raise InputError(f"{path}: not memsim plan's plan.json (no 'run' and 'layouts')")
    usable = plan.get("usable_GiB")
    if not isinstance(usable, (int, float)) or usable <= 0:
        raise InputError(f"{path}: 'usable_GiB' is missing or not a positive number")
    curve = plan.get("sequence_curve", [])
    if not isinstance(curve, list) or not all(
            isinstance(p, dict) and isinstance(p.get("seq_length"), int) and
            isinstance(p.get("fits"), bool) for p in curve):
        raise InputError(f"{path}: 'sequence_curve' entries need seq_length and fits")
    layouts = [x for x in plan["layouts"]
               if isinstance(x, dict) and x.get("verdict") == "fits" and
               isinstance(x.get("step_s"), (int, float))]
    return curve, layouts, float(usable)


def sequence_figure(curve: list[dict], usable_gib: float, title: str) -> plt.Figure:
    """Peak reserved memory (fullest stage) against sequence length, log2 x axis."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [p for p in curve if isinstance(p.get("peak_reserved_GiB"), (int, float))]
    xs = [p["seq_length"] for p in points]
    ys = [p["peak_reserved_GiB"] for p in points]
    ax.plot(xs, ys, marker="o", color="#4c72b0", label="peak reserved (fullest stage)")
    for x, y, p in zip(xs, ys, points):
        ax.annotate(f"{y:.1f}" + ("" if p["fits"] else " (OOM)"), (x, y), xytext=(0, 6),
                    textcoords="offset points", ha="center", fontsize=8)
    ax.axhline(usable_gib, color="#c44e52", linestyle="--", label=f"usable {usable_gib:.1f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("Sequence length (tokens)")
    ax.set_ylabel("Peak reserved memory (GiB)")
    ax.set_title(f"Best layout: memory vs sequence length\n{title}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(y=0.15)
    return fig


def step_figure(layouts: list[dict], title: str, shown: int = 15) -> plt.Figure:
    """Step time of the fastest layouts that fit, fastest on top, with their headroom."""
    top = layouts[:shown]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(top) + 1.5))
    names = [f"TP{x['tp']} PP{x['pp']} VPP{x['vpp']} CP{x['cp']} EP{x['ep']} mbs"
             f"{x['micro_batch_size']} {x['recompute']}" for x in top]
    values = [x["step_s"] for x in top]
    bars = ax.barh(range(len(top)), values, color="#4c72b0")
    for bar, x in zip(bars, top):
        headroom = x.get("headroom_GiB")
        label = f"{x['step_s']:.2f} s" + (f", headroom {headroom:.1f} GiB"
                                           if isinstance(headroom, (int, float)) else "")
        ax.annotate(label, (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(top)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("Step time from the virtual clock (s)")
    ax.set_title(f"Layouts that fit, fastest first\n{title}", fontsize=9)
    ax.margins(x=0.35)
    return fig
