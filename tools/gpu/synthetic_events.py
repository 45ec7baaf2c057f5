#!/usr/bin/env python3
"""Writes a seeded random allocator event file (format: snapshot_events.py).

Model runs repeat a few sizes; these sequences reach the caching allocator's edges that
they may miss: sizes at each pool and segment boundary (512 B, 1 MiB, 10 MiB, 20 MiB and
one byte either side), small and large requests interleaved, frees in random order so
blocks split and merge, and empty_cache() calls. The same seed gives the same file.

Usage: synthetic_events.py SEED EVENTS LIVE_LIMIT_MIB OUT.events[.gz]
"""
import gzip
import random
import sys

MiB = 1 << 20
BOUNDARIES = [1, 511, 512, 513, MiB - 512, MiB, MiB + 1, 2 * MiB, 2 * MiB + 1,
              10 * MiB - 1, 10 * MiB, 10 * MiB + 1, 20 * MiB, 20 * MiB + 1, 40 * MiB + 512]


def size_of(rng):
    kind = rng.random()
    if kind < 0.4:
        return int(2 ** rng.uniform(0, 20))  # small pool: 1 B .. 1 MiB
    if kind < 0.5:
        return rng.choice(BOUNDARIES)
    return int(2 ** rng.uniform(20, 28))  # large pool: 1 MiB .. 256 MiB


def events(seed, count, live_limit_bytes):
    rng = random.Random(seed)
    live = {}  # allocation index -> bytes
    live_bytes = 0
    allocations = 0
    out = []
    while len(out) < count:
        if len(out) % 2500 == 2499:
            out.append("e")
            continue
        size = size_of(rng)
        if live and (rng.random() < 0.45 or live_bytes + size > live_limit_bytes):
            index = rng.choice(list(live))
            live_bytes -= live.pop(index)
            out.append(f"f {index}")
            continue
        live[allocations] = size
        live_bytes += size
        allocations += 1
        out.append(f"a {size}")
    return out


def main(argv):
    if len(argv) != 5:
        sys.exit("usage: synthetic_events.py SEED EVENTS LIVE_LIMIT_MIB OUT.events[.gz]")
    seed, count, limit_mib, path = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    lines = events(seed, count, limit_mib * MiB)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write(f"# synthetic_events.py {seed} {count} {limit_mib}\n")
        f.write("\n".join(lines) + "\n")
    print(f"{path}: {len(lines)} events")


if __name__ == "__main__":
    main(sys.argv)
