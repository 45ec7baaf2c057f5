"""Lining up a simulated iteration's clock with a real one's (memsim compare --align).

memsim's virtual clock is a roofline estimate: a simulated iteration can be several times
shorter or longer than the measured one, and its phases need not have the real
proportions. Memory is what is compared, so the time axis is only there to put the same
moment of the two iterations above each other. Three alignments:

  none    each run on its own clock, from its iteration's first sample
  start   the simulated iteration stretched uniformly to the real one's length, so both
          start and end together
  phases  the simulated iteration stretched piecewise so that the forward, backward and
          optimizer phases start where the real ones do

Note [Phases from the curve's shape]
A real trace carries no phase markers, so the phases are read from the allocated-memory
curve, the same way on both sides. With `low` the first sample (the static memory the
iteration starts from) and `range` the peak minus `low`:
  * the forward phase starts at the first sample;
  * the backward phase starts at the first sample within 3% of `range` below the peak:
    activations grow through the forward passes (all warm-up microbatches under a
    pipeline schedule) and the first backward pass starts freeing them;
  * the optimizer phase starts at the first sample, after the last one above
    `low + range/2`, that is back within 10% of `range` above `low`: the last backward
    pass has freed its activations, and what follows (gradient reduction, the optimizer
    step, the parameter all-gather) is the step;
  * the iteration ends at the last sample.
A curve whose peak is its first sample, or whose anchors do not come in this order, has
no phases to find (find_phases returns None); `--align phases` then stretches that rank
uniformly and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALIGNMENTS = ("none", "start", "phases")
BACKWARD_FRACTION = 0.97  # of the range: the forward passes have reached their peak
HIGH_FRACTION = 0.5  # of the range: still inside a backward pass
LOW_FRACTION = 0.1  # of the range: activations freed, back at static memory


@dataclass(frozen=True)
class Phases:
    """Where each phase of one iteration starts, in seconds from its first sample."""

    backward_s: float
    optimizer_s: float
    end_s: float
    after_forward_mb: float  # allocated memory when the backward phase starts

    def anchors(self) -> list[float]:
        """The phase boundaries in order: forward, backward, optimizer, end."""
        return [0.0, self.backward_s, self.optimizer_s, self.end_s]


def find_phases(times_s: list[float], allocated_mb: list[float]) -> Phases | None:
    """The phases of one iteration (Note [Phases from the curve's shape]).

    REQUIRES: times_s sorted, starting at 0, as long as allocated_mb.
    """
    if len(allocated_mb) < 3:
        return None
    values = np.asarray(allocated_mb, dtype=float)
    low, peak = values[0], values.max()
    span = peak - low
    if not span > 0:
        return None
    backward = int(np.argmax(values >= low + BACKWARD_FRACTION * span))
    last_high = int(np.flatnonzero(values > low + HIGH_FRACTION * span)[-1])
    after = np.flatnonzero(values[last_high + 1:] <= low + LOW_FRACTION * span)
    if not after.size:
        return None
    optimizer = last_high + 1 + int(after[0])
    phases = Phases(backward_s=times_s[backward], optimizer_s=times_s[optimizer],
                    end_s=times_s[-1], after_forward_mb=float(values[backward]))
    anchors = phases.anchors()
    if any(b <= a for a, b in zip(anchors, anchors[1:])):
        return None
    return phases


def align_times(sim_times_s: list[float], sim_phases: Phases | None,
                real_end_s: float, real_phases: Phases | None,
                alignment: str) -> tuple[list[float], str]:
    """The simulated sample times on the real iteration's clock, and the alignment used
    ("phases" falls back to "start" when either curve has no phases to find).

    REQUIRES: alignment in ALIGNMENTS; sim_times_s sorted, starting at 0.
    """
    sim_end = sim_times_s[-1] if sim_times_s else 0.0
    if alignment == "phases" and sim_phases is not None and real_phases is not None:
        return list(np.interp(sim_times_s, sim_phases.anchors(), real_phases.anchors())), \
            "phases"
    if alignment == "none" or not (sim_end > 0 and real_end_s > 0):
        return list(sim_times_s), "none"
    scale = real_end_s / sim_end
    return [t * scale for t in sim_times_s], "start"
