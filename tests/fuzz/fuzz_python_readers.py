"""A mutation fuzzer for the Python tools' readers of memsim's and PyTorch's files: memory
traces (JSON), run summaries (JSON) and memory snapshots (pickle).

libFuzzer cannot drive Python, so this is a small runner of the same kind: it starts from
seed files (memsim's own outputs, which the test writes, plus the inputs kept in
tests/fuzz/seeds/python_readers/), mutates them (bytes: flips, cuts, repeats, insertions of
interesting tokens; JSON: a random value replaced by an extreme one, deep nesting, huge
integers) and feeds each mutant to its reader. A reader may accept the input or refuse it
with an InputError (the one-line error the tools print); anything else is a crash: the
input is written to the crash folder and the runner exits 1 with the traceback.

    fuzz_python_readers.py SECONDS SEED_DIR... [--crashes DIR] [--seed N]

At the end it prints the executions, the distinct outcomes (accepted, or refused with an
error of a given shape) and the line coverage of the reader modules over the inputs that
gave a new outcome (measured with sys.settrace, on that corpus only, so that the fuzzing
itself runs at full speed).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

PLOTS = Path(__file__).resolve().parents[2] / "tools" / "plots"
sys.path.insert(0, str(PLOTS))

import common  # noqa: E402
import report  # noqa: E402
import snapshot  # noqa: E402
import traces  # noqa: E402
import view  # noqa: E402
from common import InputError  # noqa: E402

# Which readers take which seed file, by its name as memsim writes it: a snapshot is read
# by `memsim analyze` (load_snapshot) and by `memsim view` (its allocator events).
READERS: list[tuple[re.Pattern, str, list[Callable[[Path], Any]]]] = [
    (re.compile(r"memory_trace_rank\d+.*\.json$"), "trace", [traces.load_trace]),
    (re.compile(r"summary_rank\d+\.json$"), "summary", [lambda p: report.load_report(0, p)]),
    (re.compile(r".*\.pickle$"), "snapshot", [snapshot.load_snapshot, view.snapshot_events]),
]
READER_MODULES = [Path(m.__file__).resolve() for m in (common, report, snapshot, traces, view)]

TOKENS = [b"{", b"}", b"[", b"]", b'"', b":", b",", b"-", b"1e999", b"NaN", b"Infinity",
          b"null", b"true", b"0", b"-1", b"9" * 400, b"\x00", b"\xff", b"\\u0000",
          b"(", b"]", b"q", b"}q\x00", b"K\xff", b"J\xff\xff\xff\x7f", b"\x80\x05", b"."]
EXTREME_VALUES: list[Any] = [None, True, -1, 0, 1e308, -1e308, float("nan"), float("inf"),
                             2**64, -(2**63), "", "x" * 1000, [], {}, [[]], {"": {}}, 0.5]


def readers_for(path: Path) -> tuple[str, list[Callable[[Path], Any]]] | None:
    for pattern, kind, readers in READERS:
        if pattern.search(path.name):
            return kind, readers
    return None


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # flip bits
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # cut the rest
            del buf[at:]
        elif op == 2 and buf:  # delete a range
            del buf[at:at + rng.randint(1, 64)]
        elif op == 3:  # insert a token
            buf[at:at] = rng.choice(TOKENS)
        elif op == 4 and buf:  # repeat a range
            end = min(len(buf), at + rng.randint(1, 256))
            buf[at:at] = bytes(buf[at:end]) * rng.randint(2, 64)
        else:  # random bytes
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(buf)


def mutate_json(value: Any, rng: random.Random) -> Any:
    """`value` with one node replaced by an extreme value, a deep nest or a huge number."""
    if isinstance(value, (dict, list)) and value and rng.random() < 0.8:
        keys = list(value.keys()) if isinstance(value, dict) else list(range(len(value)))
        key = rng.choice(keys)
        copy = dict(value) if isinstance(value, dict) else list(value)
        copy[key] = mutate_json(value[key], rng)
        if isinstance(copy, dict) and rng.random() < 0.1:
            copy.pop(key)  # a missing field
        return copy
    choice = rng.randrange(4)
    if choice == 0:
        nest: Any = 1
        for _ in range(rng.choice([10, 100, 2000])):
            nest = [nest]
        return nest
    if choice == 1:
        return int("9" * rng.choice([20, 400, 5000]))
    if choice == 2 and isinstance(value, list):
        return value * rng.randint(2, 100)
    return rng.choice(EXTREME_VALUES)


def mutant(data: bytes, kind: str, rng: random.Random) -> bytes:
    if kind != "snapshot" and rng.random() < 0.5:
        try:
            text = json.dumps(mutate_json(json.loads(data), rng))
            return text.encode()
        except (ValueError, RecursionError):
            pass  # the seed is not JSON (an earlier mutant kept as a seed)
    return mutate_bytes(data, rng)


class UnraisableError(Exception):
    """Python printed an error it could not raise: a line on stderr beside the tool's
    one-line error, so a crash here."""


UNRAISABLE: list[str] = []


def outcome(readers: list[Callable[[Path], Any]], path: Path) -> str:
    """Each reader's "accepted" or refusal shape (numbers and the path removed), joined;
    raises on a crash."""
    UNRAISABLE.clear()
    shapes = []
    for read in readers:
        try:
            read(path)
            shapes.append("accepted")
        except InputError as e:
            shapes.append("refused: " + re.sub(r"\d+", "N", str(e).replace(str(path), "PATH"))[:120])
    if UNRAISABLE:
        raise UnraisableError(UNRAISABLE[0])
    return " | ".join(shapes)


def line_coverage(corpus: list[tuple[list[Callable[[Path], Any]], Path]]) -> tuple[int, int]:
    """(lines run, executable lines) of the reader modules over `corpus`."""
    executed: set[tuple[str, int]] = set()
    wanted = {str(p) for p in READER_MODULES}

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename in wanted:
            executed.add((frame.f_code.co_filename, frame.f_lineno))
            return tracer
        return None

    sys.settrace(tracer)
    try:
        for readers, path in corpus:
            for read in readers:
                try:
                    read(path)
                except InputError:
                    pass
    finally:
        sys.settrace(None)
    total = 0
    for module in READER_MODULES:
        code = compile(module.read_text(), str(module), "exec")
        total += len(_code_lines(code))
    return len(executed), total


def _code_lines(code: Any) -> set[int]:
    lines = {line for _, _, line in code.co_lines() if line is not None}
    for const in code.co_consts:
        if hasattr(const, "co_lines"):
            lines |= _code_lines(const)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seconds", type=float)
    p.add_argument("seed_dirs", type=Path, nargs="+")
    p.add_argument("--crashes", type=Path, default=Path("fuzz_crashes"))
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the time)")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else time.time_ns()
    rng = random.Random(seed)
    seeds = []
    for folder in args.seed_dirs:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and (found := readers_for(path)):
                seeds.append((found[0], found[1], path.read_bytes(), path.name))
    if not seeds:
        print("fuzz_python_readers: no seed files (memory_trace_rank*.json, "
              "summary_rank*.json, *.pickle) in " + ", ".join(map(str, args.seed_dirs)),
              file=sys.stderr)
        return 2
    # CPython reports some errors it cannot raise through one hook or the other
    # (bytearray_dealloc calls PyErr_Print, which calls sys.excepthook).
    sys.unraisablehook = lambda u: UNRAISABLE.append(f"{u.exc_type.__name__}: {u.exc_value}")
    sys.excepthook = lambda kind, value, tb: UNRAISABLE.append(f"{kind.__name__}: {value}")
    work = Path(tempfile.mkdtemp(prefix="memsim_fuzz_py_"))
    seen: dict[str, int] = {}
    corpus: list[tuple[list[Callable[[Path], Any]], Path]] = []
    executions = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        kind, readers, data, name = rng.choice(seeds)
        mutated = mutant(data, kind, rng)
        path = work / f"{executions}_{name}"
        path.write_bytes(mutated)
        executions += 1
        try:
            shape = outcome(readers, path)
        except Exception:  # anything but InputError: a crash
            args.crashes.mkdir(parents=True, exist_ok=True)
            kept = args.crashes / f"crash_{seed}_{executions}_{name}"
            kept.write_bytes(mutated)
            traceback.print_exc()
            print(f"fuzz_python_readers: crash on {kept} ({kind} reader, seed {seed})",
                  file=sys.stderr)
            return 1
        if shape not in seen:
            seen[shape] = 0
            corpus.append((readers, path))
            if len(mutated) < 1 << 20:
                seeds.append((kind, readers, mutated, name))  # mutate it further
        else:
            path.unlink()
        seen[shape] += 1
    covered, total = line_coverage(corpus)
    print(f"fuzz_python_readers: {executions} executions in {args.seconds:g} s (seed {seed}), "
          f"no crash; {len(seen)} distinct outcomes; reader lines covered by them: "
          f"{covered} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
