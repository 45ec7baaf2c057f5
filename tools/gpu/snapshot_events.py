#!/usr/bin/env python3
"""Turns the allocation history of a memory snapshot into an allocator event file.

A snapshot written by `memsim simulate --snapshot-history run` holds, in
device_traces, every allocation and free the caching allocator saw. This keeps the part
a caching allocator decides on: the requested sizes, in order, and which allocation each
free returns. `measure.py allocator` feeds such a file to a real CUDA caching allocator;
simulator/caching_allocator_replay_test.cc feeds it to memsim's model. (PyTorch's own
snapshots differ in one point this relies on: memsim writes the segment_free entries of
an empty_cache() without frames, which is how they are told from the allocator's own
releases.)

Event file format (text, one event per line, '#' lines are comments):
    a BYTES   allocate BYTES (as requested, before rounding)
    f INDEX   free the INDEX-th allocation of the file (0-based, counting 'a' lines)
    e         torch.cuda.empty_cache()

Usage: snapshot_events.py SNAPSHOT.pickle OUT.events[.gz]
"""
import gzip
import pickle
import sys


def events_of(snapshot):
    """Yields the event lines of `snapshot`'s first device trace."""
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not traces:
        raise ValueError("the snapshot has no device_traces; write it with "
                         "--snapshot-history run")
    live = {}  # address -> allocation index
    allocations = 0
    emptying = False  # inside a run of segment releases with no allocation
    for entry in traces[0]:
        action = entry["action"]
        if action == "alloc":
            if entry["addr"] in live:
                raise ValueError(f"address {entry['addr']:#x} allocated twice")
            live[entry["addr"]] = allocations
            allocations += 1
            emptying = False
            yield f"a {entry['size']}"
        elif action == "free_completed":
            index = live.pop(entry["addr"], None)
            if index is None:
                raise ValueError(f"free of address {entry['addr']:#x}, never allocated "
                                 "(the history does not start at the first allocation)")
            emptying = False
            yield f"f {index}"
        elif action in ("segment_free", "segment_unmap") and not entry.get("frames"):
            # In memsim's snapshots a segment released by no allocation is empty_cache()'s.
            if not emptying:
                yield "e"
            emptying = True


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: snapshot_events.py SNAPSHOT.pickle OUT.events[.gz]")
    with open(argv[1], "rb") as f:
        snapshot = pickle.load(f)
    lines = list(events_of(snapshot))
    opener = gzip.open if argv[2].endswith(".gz") else open
    with opener(argv[2], "wt") as out:
        out.write(f"# allocator events of {argv[1].split('/')[-1]} "
                  "(tools/gpu/snapshot_events.py)\n")
        out.write("\n".join(lines) + "\n")
    print(f"{argv[2]}: {len(lines)} events")


if __name__ == "__main__":
    main(sys.argv)
