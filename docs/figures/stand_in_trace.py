#!/usr/bin/env python3
"""A stand-in for a real trace, for the README's compare figure: memsim's own trace of one
rank, re-timed so its phases last what a real GPU iteration's might (forward, backward and
optimizer stretched by different factors) and its activations scaled, written in the same
schema. No real GPU trace is in this repository; this one only shows what
`memsim compare --align phases` does when the clocks and proportions differ.

usage: stand_in_trace.py SIM_TRACE OUT_TRACE
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "plots"))
from align import find_phases  # noqa: E402

# Seconds each phase lasts in the stand-in, and the activations' scale.
FORWARD_S, BACKWARD_S, OPTIMIZER_S = 0.9, 1.6, 0.35
ACTIVATION_SCALE = 1.04


def main(source: Path, target: Path) -> None:
    trace = json.loads(source.read_text())
    key = max(trace, key=int)  # the last iteration, which compare draws
    iteration = trace[key]
    samples = iteration["samples"]
    start = samples[0]["timestamp_s"]
    times = [s["timestamp_s"] - start for s in samples]
    phases = find_phases(times, [s["allocated_memory_MB"] for s in samples])
    if phases is None:
        sys.exit(f"{source}: no phases found in iteration {key}")
    real_anchors = np.cumsum([0.0, FORWARD_S, BACKWARD_S, OPTIMIZER_S])
    new_times = np.interp(times, phases.anchors(), real_anchors)
    static = iteration["static_memory_MB"]
    for sample, t in zip(samples, new_times):
        sample["timestamp_s"] = 100.0 + float(t)  # a real run's clock is far from zero
        above = sample["allocated_memory_MB"] - static
        sample["allocated_memory_MB"] = static + ACTIVATION_SCALE * above
    iteration["peak_allocated_MB"] = max(s["allocated_memory_MB"] for s in samples)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({key: iteration}))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
