"""Writes a libFuzzer dictionary for a parser: the keys and flags it reads, taken from the
string literals of its source, plus the syntax of its format, so the dictionary never falls
behind the parser.

    make_dict.py OUTPUT FORMAT SOURCE...      (FORMAT: yaml, json or args)
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

# A key ("num_layers", "hidden_act") or a flag ("--num-layers") as the source spells it.
LITERAL = re.compile(r'"(--[a-z0-9][a-z0-9-]*|[A-Za-z_][A-Za-z0-9_.]{1,39})"')
SYNTAX = {
    "yaml": [": ", "\n", "\n  ", "- ", "[", "]", "{", "}", "&a", "*a", "<<: ", "!!int ", "~",
             "null", "true", "1e400", "-1", "0x7fffffffffffffff", "'", "\""],
    "json": ["{", "}", "[", "]", ":", ",", "\"", "null", "true", "1e400", "-1",
             "9223372036854775808", "\\u0000"],
    "args": [" ", "=", "0", "-1", "1e400", "9223372036854775808", "[1,0]", "[0]*3+[1]*2",
             "true"],
}


def quoted(token: str) -> str:
    """A dictionary entry: printable ASCII as is, the rest as \\xNN."""
    out = []
    for byte in token.encode():
        char = chr(byte)
        if char in '"\\' or not 32 <= byte < 127:
            out.append(f"\\x{byte:02x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] not in SYNTAX:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    output, syntax, sources = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    tokens = set(SYNTAX[syntax])
    for source in sources:
        tokens |= set(LITERAL.findall(Path(source).read_text()))
    text = "".join(quoted(t) + "\n" for t in sorted(tokens))
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=output.parent, delete=False) as f:
        f.write(text)
    os.replace(f.name, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
