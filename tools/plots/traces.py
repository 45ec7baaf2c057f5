"""Reading memory traces in the schema of Megatron-LM's memory tracer (which memsim also
writes): {"<iteration>": {"samples": [{timestamp_s, allocated_memory_MB,
reserved_memory_MB}], "peak_allocated_MB", "static_memory_MB"?, "theoretical_memory_MB"?}}.

`compare` draws the last iteration: earlier ones include warm-up (first-touch
allocations, lazily created optimizer state), so the last one is the steady state.
`heatmap` takes the largest peak of any iteration: that is what has to fit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from common import InputError, load_json, number, optional_number, typed

TRACE_GLOB = "memory_trace_rank*.json"
_RANK = re.compile(r"^memory_trace_rank(\d+)(?:_.*)?\.json$")


@dataclass(frozen=True)
class Iteration:
    """One iteration of a trace, times re-zeroed to its first sample."""

    number: int
    start_s: float  # the first sample's timestamp (0 without samples)
    times_s: list[float]
    allocated_mb: list[float]
    reserved_mb: list[float]  # the allocated values where samples give no reserved memory
    has_reserved: bool  # whether any sample gave reserved_memory_MB
    peak_allocated_mb: float
    static_mb: float | None
    theoretical_mb: float | None  # None when unknown (absent or <= 0, e.g. -1)


def trace_rank(path: Path) -> int | None:
    """The rank in memory_trace_rank{R}.json or memory_trace_rank{R}_<layout>.json."""
    match = _RANK.match(path.name)
    return int(match.group(1)) if match else None


def trace_files(folder: Path, hint: str) -> list[Path]:
    """The memory_trace_rank*.json files in `folder`; InputError when there are none."""
    files = sorted(folder.glob(TRACE_GLOB))
    if not files:
        raise InputError(f"no {TRACE_GLOB} files in {folder}; {hint}")
    for path in files:
        if trace_rank(path) is None:
            raise InputError(f"{path}: cannot read a rank from the name; expected "
                             "memory_trace_rank{R}.json or memory_trace_rank{R}_<layout>.json")
    return files


def load_trace(path: Path) -> list[Iteration]:
    """Loads and validates every iteration of a trace, in iteration order."""
    data = load_json(path)
    if not isinstance(data, dict) or not data:
        raise InputError(f"{path}: expected an object of iterations "
                         '{"0": {"samples": [...], "peak_allocated_MB": ...}}; regenerate it')
    iterations = []
    for key, entry in data.items():
        try:
            iteration = int(key)
        except ValueError:
            raise InputError(f"{path}: top-level key {key!r} is not an iteration "
                             "number; not a memory trace") from None
        iterations.append(_iteration(iteration, entry, f"{path}: iteration {iteration}"))
    return sorted(iterations, key=lambda it: it.number)


def last_iteration(path: Path) -> Iteration:
    """The last (largest-numbered) iteration of a trace."""
    return load_trace(path)[-1]


def _iteration(iteration: int, entry: object, where: str) -> Iteration:
    """One validated iteration; the peak falls back to the largest sample."""
    if not isinstance(entry, dict):
        raise InputError(f"{where} is not an object; not a memory trace")
    times, allocated, reserved, has_reserved = _samples(entry, where)
    peak = optional_number(entry, "peak_allocated_MB", where)
    if peak is None:
        if not allocated:
            raise InputError(f"{where} has neither 'peak_allocated_MB' nor samples")
        peak = max(allocated)
    theoretical = optional_number(entry, "theoretical_memory_MB", where)
    return Iteration(
        number=iteration,
        start_s=times[0] if times else 0.0,
        times_s=[t - times[0] for t in times],
        allocated_mb=allocated,
        reserved_mb=reserved,
        has_reserved=has_reserved,
        peak_allocated_mb=peak,
        static_mb=optional_number(entry, "static_memory_MB", where),
        theoretical_mb=theoretical if theoretical is not None and theoretical > 0 else None,
    )


def _samples(entry: dict, where: str) -> tuple[list[float], list[float], list[float], bool]:
    """(times, allocated, reserved, whether any sample gave reserved) of an iteration,
    sorted by time."""
    samples = typed(entry, "samples", list, where) if "samples" in entry else []
    rows, has_reserved = [], False
    for i, sample in enumerate(samples):
        at = f"{where}, sample {i}"
        if not isinstance(sample, dict):
            raise InputError(f"{at} is not an object")
        allocated = number(sample, "allocated_memory_MB", at)
        reserved = optional_number(sample, "reserved_memory_MB", at)
        has_reserved = has_reserved or reserved is not None
        rows.append((number(sample, "timestamp_s", at), allocated,
                     allocated if reserved is None else reserved))
    rows.sort(key=lambda row: row[0])
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], has_reserved
