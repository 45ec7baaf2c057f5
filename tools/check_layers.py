#!/usr/bin/env python3
"""Refuses an #include against memsim's layering (Note [Layers] in README.md).

Each layer may include its own headers and those of the layers below it:

    tools/lib -> parallel -> models -> parallel/regions -> ops -> simulator

tools/memsim_main.cc sits above tools/lib; tests/ and benchmarks/ may include anything, and
so may a unit's test beside it (NAME_test.cc, which the unit's library does not contain).
The build gives each layer its own library linking only the layers below (CMakeLists.txt);
this check also catches what no linker sees (a header-only use, a type from above).

Usage: tools/check_layers.py [--root DIR]   exit 0: clean; 1: one line per wrong include.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# Bottom first; a layer may include itself and every layer before it.
LAYERS = ("simulator", "ops", "parallel/regions", "models", "parallel", "tools/lib", "tools")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path: str) -> str | None:
    """The layer a repository-relative path belongs to: its folder (the longest match)."""
    folder = path.rsplit("/", 1)[0] if "/" in path else ""
    return folder if folder in LAYERS else None


def wrong_includes(root: Path) -> list[str]:
    problems = []
    for rank, layer in enumerate(LAYERS):
        allowed = LAYERS[: rank + 1]
        folder = root / layer
        if not folder.is_dir():
            continue
        for source in sorted(folder.iterdir()):
            if source.suffix not in (".h", ".cc") or source.name.endswith("_test.cc"):
                continue
            for number, line in enumerate(source.read_text(errors="replace").splitlines(), 1):
                match = INCLUDE.match(line)
                if match is None:
                    continue
                included = match.group(1)
                target = layer_of(included)
                if target is None and not (root / included).exists():
                    continue  # a system header spelled with quotes
                if target not in allowed:
                    below = ", ".join(f"{name}/" for name in allowed[:-1]) or "nothing else"
                    problems.append(
                        f"{layer}/{source.name}:{number}: includes {included}, but {layer}/ may "
                        f"include only itself and the layers below it ({below}); move the code "
                        "to the lower layer or pass what it needs down")
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="repository root (default: this script's repository)")
    args = parser.parse_args(argv)
    problems = wrong_includes(args.root)
    for problem in problems:
        print(f"check_layers: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
