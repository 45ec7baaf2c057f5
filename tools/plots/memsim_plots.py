#!/usr/bin/env python3
"""The plotting and analysis commands of memsim, which `memsim <command>` runs as
`python3 tools/plots/memsim_plots.py <command> [args]`:

  compare   real vs simulated memory traces, per rank, with a peak-error summary
  heatmap   peak memory of a TP x PP sweep as a heatmap (PNG and PDF)
  analyze   a PyTorch memory snapshot: categories, largest allocations, fragmentation
  report    a memsim output folder: memory by phase, by module, tensors at the peak
  view      a memsim output folder as one self-contained HTML page
  plan-figures  memsim plan's figures (memsim plan runs it on its --out folder)

Errors in the input are one line on stderr, `memsim <command>: <problem>`, and exit
code 2, like the rest of memsim; output is written all-or-nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

from common import InputError

COMMANDS = ("compare", "heatmap", "analyze", "report", "view", "plan-figures")
USAGE = f"usage: memsim_plots.py {{{','.join(COMMANDS)}}} [options]  (<command> --help for more)"


def main(argv: list[str]) -> int:
    """Runs one command and maps its failures to memsim's exit codes."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    command = argv[0] if argv else ""
    if command not in COMMANDS:
        problem = f"unknown command '{command}'" if command else "no command given"
        print(f"memsim: {problem}; {USAGE}", file=sys.stderr)
        return 2
    try:
        module = load_command(command)
        module.run(module.parser().parse_args(argv[1:]))
    except InputError as e:
        return fail(command, str(e))
    except OSError as e:  # writing the output: a full disk, a read-only folder
        return fail(command, f"{e.filename or 'output'}: {e.strerror or e}")
    except Exception as e:  # a bug, not bad input: still one line unless debugging
        if os.environ.get("MEMSIM_PLOTS_DEBUG"):
            raise
        fail(command, f"internal error: {type(e).__name__}: {e} "
                      "(rerun with MEMSIM_PLOTS_DEBUG=1 for a traceback and report it)")
        return 1
    return 0


def load_command(command: str) -> ModuleType:
    """Imports the command's module with matplotlib's file-only backend selected, so
    plotting works without a display; a missing library becomes an InputError."""
    for library in ("matplotlib", "numpy"):
        if importlib.util.find_spec(library) is None:
            raise InputError(f"Python module '{library}' is not installed for "
                             f"{sys.executable}; install it (Debian: apt-get install "
                             "python3-matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    return importlib.import_module(command.replace("-", "_"))


def fail(command: str, message: str) -> int:
    """Prints memsim's one-line error and returns its exit code."""
    print(f"memsim {command}: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
