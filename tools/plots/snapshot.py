"""Reading PyTorch memory snapshots (torch.cuda.memory._snapshot() / _dump_snapshot, and
memsim's snapshot_rank{R}.pickle) and the numbers `memsim analyze` reports.

A snapshot is a pickle of plain data: {"segments": [...], "device_traces": [...]} since
PyTorch 2.0, a bare list of segments before. Each segment has blocks; a block whose
state starts with "active" is allocated (active_pending_free is still held by a stream).

Categories come from the allocation's stack frames: memsim writes the exact category as
a "memsim://category/<name>" frame (Note [Snapshot frames] in
simulator/snapshot_writer.h); other snapshots are classified by keywords.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import resource
except ImportError:  # not on Linux: reads are not bounded
    resource = None  # type: ignore[assignment]

from common import InputError, shown

MB = 2**20
MEMSIM_CATEGORY = "memsim://category/"
MEMSIM_TENSOR = "memsim://tensor"
# memsim's category names (kCategoryNames) are shown title-cased ("optimizer_state" ->
# "Optimizer State"), so no copy of them is kept here; only memsim's "unattributed" takes
# the analyzer's own name for what no rule explains.
MEMSIM_CATEGORY_LABELS = {"unattributed": "Unknown"}
# Checked in this order, so a MoE layer's attention counts as Expert/MoE.
KEYWORDS = [
    ("Expert/MoE", ("expert", "moe")),
    ("Attention", ("attn", "attention", "softmax", "flash")),
    ("Linear/MatMul", ("linear", "matmul", "mm", "bmm", "addmm", "fc")),
    ("Optimizer State", ("optim", "adam", "exp_avg")),
    ("Communication", ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "nccl",
                       "comm")),
    ("FSDP", ("fsdp",)),
    ("Gradient", ("grad",)),
]
UNKNOWN = "Unknown"


def _keyword_pattern(words: tuple[str, ...]) -> re.Pattern:
    """Short keywords must start a word, or "mm" would match "comm" and "grad" would
    match "autograd" (every backward frame); long ones may appear anywhere."""
    parts = [re.escape(w) if len(w) >= 5 else rf"(?<![a-z]){re.escape(w)}" for w in words]
    return re.compile("|".join(parts))


_KEYWORD_PATTERNS = [(category, _keyword_pattern(words)) for category, words in KEYWORDS]


@dataclass(frozen=True)
class Frame:
    """One stack frame of an allocation (for memsim: module/op, category, tensor)."""

    filename: str
    line: int
    name: str


@dataclass(frozen=True)
class Block:
    """One block of a segment: an allocation (active) or cached free memory."""

    size: int
    requested: int
    state: str
    frames: tuple[Frame, ...]

    @property
    def active(self) -> bool:
        """Allocated: active_allocated, or active_pending_free (still held by a stream)."""
        return self.state.startswith("active")


@dataclass(frozen=True)
class Segment:
    """One cudaMalloc'd segment (memory reserved by the caching allocator)."""

    total_size: int
    segment_type: str  # the allocator pool: "large" or "small"
    blocks: tuple[Block, ...]
    expandable: bool = False  # mapped pages of an expandable segment (is_expandable)


@dataclass(frozen=True)
class Allocation:
    """An active block with what the analysis needs to know about it."""

    size: int
    requested: int
    category: str
    label: str  # where it was allocated, for people
    phase: str  # setup/forward/backward/optimizer, or "" when the frames do not say


@dataclass(frozen=True)
class Snapshot:
    """A loaded snapshot and its totals."""

    path: Path
    segments: tuple[Segment, ...]
    # The allocator's trace records an out-of-memory error ("oom" entries, PyTorch 2.x).
    saw_oom: bool = False

    @property
    def exact(self) -> bool:
        """True when memsim wrote the exact categories into the frames."""
        return any(f.filename.startswith(MEMSIM_CATEGORY) for b in self.blocks for f in b.frames)

    @property
    def blocks(self) -> list[Block]:
        return [b for s in self.segments for b in s.blocks]

    @property
    def reserved(self) -> int:
        return sum(s.total_size for s in self.segments)

    @property
    def allocated(self) -> int:
        return sum(b.size for b in self.blocks if b.active)

    @property
    def efficiency_pct(self) -> float:
        return self.allocated / self.reserved * 100


class _PlainUnpickler(pickle.Unpickler):
    """Refuses to import classes: a snapshot is plain data, and unpickling classes from
    an arbitrary file would run arbitrary code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it references the Python class {module}.{name}")


@contextmanager
def bounded_memory(path: Path) -> Iterator[None]:
    """Reading and walking the snapshot `path` may take max(2 GiB, 64 x its size) more
    memory; beyond that it is an InputError, not an exhausted machine. A pickle can ask for
    far more than its size: a huge memo index makes the unpickler allocate a table that
    large, and lists shared by reference many times over are walked as often."""
    limits = None  # (the limit set, the limits to restore) when this call set one
    try:
        headroom = max(2 << 30, 64 * path.stat().st_size)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as statm:
            in_use = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = in_use + headroom if hard == resource.RLIM_INFINITY else min(in_use + headroom,
                                                                               hard)
        # Unless already bounded as tightly (by a caller, or by the user's ulimit).
        if soft == resource.RLIM_INFINITY or soft > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            limits = (soft, hard)
    except (AttributeError, OSError, ValueError):
        pass  # no limit to set here: another system, or the file is unreadable
    try:
        yield
    except MemoryError:
        raise InputError(f"{path}: reading it takes more memory than a snapshot of its size "
                         "can need; not a snapshot PyTorch or memsim wrote (corrupt, or made "
                         "to exhaust memory)") from None
    finally:
        if limits is not None:
            resource.setrlimit(resource.RLIMIT_AS, limits)


@contextmanager
def _errors_not_printed() -> Iterator[None]:
    """CPython prints some errors of a failing unpickler itself (a half-made bytearray
    freed while its buffer is exported calls PyErr_Print): they belong to the one-line
    refusal, not on stderr beside it."""
    hooks = sys.excepthook, sys.unraisablehook
    sys.excepthook, sys.unraisablehook = (lambda *_: None), (lambda _: None)
    try:
        yield
    finally:
        sys.excepthook, sys.unraisablehook = hooks


def read_snapshot_pickle(path: Path) -> Any:
    """The plain data of a snapshot pickle (no classes imported); an unreadable or corrupt
    file is an InputError naming `path`. Read within bounded_memory."""
    try:
        with open(path, "rb") as f, bounded_memory(path), _errors_not_printed():
            return _PlainUnpickler(f).load()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except (InputError, MemoryError):
        raise  # MemoryError: bounded_memory's refusal, by this call's or the caller's
    except Exception as e:  # pickle reports corruption as many exception types
        raise InputError(f"{path}: not a readable snapshot pickle ({type(e).__name__}: {e}); "
                         "the file is truncated or corrupt, dump the snapshot again") from None


def load_snapshot(path: Path) -> Snapshot:
    """Loads and validates a snapshot; every problem is an InputError naming `path`."""
    with bounded_memory(path):
        return _validated(path, read_snapshot_pickle(path))


def _validated(path: Path, data: Any) -> Snapshot:
    """The Snapshot of a pickle's plain data, every field checked."""
    raw_segments = data.get("segments") if isinstance(data, dict) else data
    if not isinstance(raw_segments, list):
        raise InputError(f"{path}: not a PyTorch memory snapshot (expected a dict with "
                         "'segments' or a list of segments)")
    if not raw_segments:
        raise InputError(f"{path}: the snapshot has no segments (nothing was reserved when "
                         "it was taken); take it at the memory peak, e.g. after the forward")
    _check_nothing_shared_over(path, raw_segments)
    segments = tuple(_segment(s, f"{path}: segment {i}") for i, s in enumerate(raw_segments))
    traces = data.get("device_traces") if isinstance(data, dict) else None
    saw_oom = isinstance(traces, list) and any(
        isinstance(device, list) and any(isinstance(e, dict) and e.get("action") == "oom"
                                         for e in device) for device in traces)
    snapshot = Snapshot(path, segments, saw_oom)
    if snapshot.reserved <= 0:
        raise InputError(f"{path}: the snapshot's segments reserve 0 bytes; not a usable "
                         "snapshot, take it while the model holds memory")
    return snapshot


def _check_nothing_shared_over(path: Path, raw_segments: list) -> None:
    """A pickle can share one list by reference many times over: [block] * 1000 costs
    2,000 bytes, and when that block holds 1,000 frames a walk visits a million. PyTorch and
    memsim store every block and frame of a snapshot on its own, at a byte or more each, so
    more blocks and frames than the file has bytes means sharing: refused before the walk."""
    budget = max(path.stat().st_size, 1)
    walked = 0
    for segment in raw_segments:
        blocks = segment.get("blocks") if isinstance(segment, dict) else None
        for block in blocks if isinstance(blocks, list) else ():
            frames = block.get("frames") if isinstance(block, dict) else None
            history = block.get("history") if isinstance(block, dict) else None
            walked += 1 + (len(frames) if isinstance(frames, (list, tuple)) else 0) + (
                len(history) if isinstance(history, list) else 0)
            if walked > budget:
                raise InputError(f"{path}: its blocks and frames are shared by reference "
                                 f"over and over (more of them than the file's {budget} bytes); "
                                 "not a snapshot PyTorch or memsim wrote")


def _segment(raw: Any, where: str) -> Segment:
    """One validated segment."""
    if not isinstance(raw, dict):
        raise InputError(f"{where} is not a dict; not a PyTorch memory snapshot")
    blocks = raw.get("blocks", [])
    if not isinstance(blocks, list):
        raise InputError(f"{where}: 'blocks' is not a list; not a PyTorch memory snapshot")
    kind = raw.get("segment_type")
    return Segment(_int(raw, "total_size", where), kind if isinstance(kind, str) else "large",
                   tuple(_block(b, f"{where}, block {i}") for i, b in enumerate(blocks)),
                   raw.get("is_expandable") is True)


def _block(raw: Any, where: str) -> Block:
    """One validated block; old snapshots keep frames in the last `history` entry."""
    if not isinstance(raw, dict):
        raise InputError(f"{where} is not a dict; not a PyTorch memory snapshot")
    state = raw.get("state")
    if not isinstance(state, str):
        raise InputError(f"{where}: missing 'state'; not a PyTorch memory snapshot")
    size = _int(raw, "size", where)
    frames = raw.get("frames")
    history = raw.get("history")
    if frames is None and isinstance(history, list) and history:
        last = history[-1]
        frames = last.get("frames") if isinstance(last, dict) else None
    requested = raw.get("requested_size")
    return Block(
        size=size,
        requested=requested if isinstance(requested, int) and requested > 0 else size,
        state=state,
        frames=_frames(frames),
    )


def _int(raw: dict, key: str, where: str) -> int:
    """raw[key], which must be a non-negative integer."""
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{where}: '{key}' is {shown(value)}, expected a byte count; not a "
                         "PyTorch memory snapshot")
    return value


def _frames(raw: Any) -> tuple[Frame, ...]:
    """Stack frames; they only inform labels, so malformed entries are skipped."""
    if not isinstance(raw, (list, tuple)):
        return ()
    return tuple(_frame(f) for f in raw if isinstance(f, dict))


def _frame(raw: dict) -> Frame:
    """A frame's fields, each of the wrong type read as empty (a frame only labels)."""
    filename, line, name = raw.get("filename"), raw.get("line"), raw.get("name")
    return Frame(filename if isinstance(filename, str) else "",
                 line if isinstance(line, int) and not isinstance(line, bool) else 0,
                 name if isinstance(name, str) else "")


def category(frames: tuple[Frame, ...]) -> str:
    """memsim's exact category when present, else the first keyword category that any
    frame's filename or function name matches."""
    for frame in frames:
        if frame.filename.startswith(MEMSIM_CATEGORY):
            name = frame.filename[len(MEMSIM_CATEGORY):]
            return MEMSIM_CATEGORY_LABELS.get(name, name.replace("_", " ").title())
    text = " ".join(f"{f.filename} {f.name}" for f in frames).lower()
    for name, pattern in _KEYWORD_PATTERNS:
        if pattern.search(text):
            return name
    return UNKNOWN


def label(frames: tuple[Frame, ...]) -> str:
    """Where a block was allocated: memsim's "module op tensor", else the innermost
    frame of user code (a .py file outside torch), else the innermost frame."""
    if any(f.filename.startswith("memsim://") for f in frames):
        module = next((f for f in frames if not f.filename.startswith("memsim://")), None)
        tensor = next((f.name for f in frames if f.filename == MEMSIM_TENSOR), "")
        where = f"{module.filename} {module.name}" if module else "<top>"
        return f"{where} {tensor}".strip()
    if not frames:
        return "<no stack recorded>"
    user = [f for f in frames if f.filename.endswith(".py") and "/torch/" not in f.filename]
    frame = (user or frames)[0]
    return f"{frame.name} ({Path(frame.filename).name}:{frame.line})"


def phase(frames: tuple[Frame, ...]) -> str:
    """The training phase of an allocation: memsim names it in the category frame
    ("<phase> iteration=.."); for real stacks, autograd and optimizer frames tell."""
    for frame in frames:
        if frame.filename.startswith(MEMSIM_CATEGORY):
            return frame.name.split(" ", 1)[0]
    text = " ".join(f"{f.filename} {f.name}" for f in frames).lower()
    if "/optim/" in text or "optimizer.step" in text:
        return "optimizer"
    return "backward" if "backward" in text or "autograd::engine" in text else ""


def allocations(snapshot: Snapshot) -> list[Allocation]:
    """The active blocks, largest first."""
    return sorted((Allocation(b.size, b.requested, category(b.frames), label(b.frames),
                              phase(b.frames)) for b in snapshot.blocks if b.active),
                  key=lambda a: -a.size)


def bytes_by_category(allocs: list[Allocation]) -> dict[str, int]:
    """Active bytes per category, largest first."""
    totals: dict[str, int] = defaultdict(int)
    for a in allocs:
        totals[a.category] += a.size
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
