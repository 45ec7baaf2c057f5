#!/usr/bin/env python3
"""Opens memsim's snapshots with the PyTorch that is installed (run it with a PyTorch 2.x;
Debian's 1.13 reads only the peak snapshot's segment list) and records what each of
torch.cuda._memory_viz's commands made of them.

Usage: check_snapshots.py OUT.json SNAPSHOT.pickle...
Each command runs as `python -m torch.cuda._memory_viz COMMAND FILE` does; the result
records its exit status, the first lines of its output, and, for the plots, the size
of the HTML page written.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

COMMANDS = ("stats", "trace", "segments", "memory", "trace_plot", "segment_plot")


def run(args):
    out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *args],
                         capture_output=True, text=True, timeout=300)
    return {"exit": out.returncode, "stdout_head": out.stdout[:1500],
            "stderr_tail": out.stderr[-1500:]}


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    results = {"torch": torch.__version__, "files": {}}
    tmp = tempfile.mkdtemp()
    for path in argv[2:]:
        name = os.path.basename(path)
        entry = {}
        for command in COMMANDS:
            args = [command, path]
            if command.endswith("_plot"):
                html = os.path.join(tmp, f"{name}.{command}.html")
                args += ["-o", html]
            entry[command] = run(args)
            if command.endswith("_plot") and os.path.exists(html):
                entry[command]["html_bytes"] = os.path.getsize(html)
            print(name, command, entry[command]["exit"], entry[command]["stderr_tail"][-300:],
                  flush=True)
        results["files"][name] = entry
    if len(argv) > 3:
        results["compare"] = run(["compare", argv[2], argv[3]])
    with open(argv[1] + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(argv[1] + ".tmp", argv[1])


if __name__ == "__main__":
    main(sys.argv)
