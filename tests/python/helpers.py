"""Shared test plumbing: run memsim_plots.py as users do (a subprocess, so exit codes and
stderr are what is tested), build real-shaped inputs, and check outputs."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "plots" / "memsim_plots.py"
# The memsim binary ctest passes; build/memsim when the tests are run by hand.
BINARY = Path(os.environ.get("MEMSIM_BINARY", REPO / "build" / "memsim"))
MB = 2**20


def plots_module(name: str):
    """A module of tools/plots, imported in this process for tests of its functions (the
    commands themselves are tested through run_cli)."""
    import matplotlib

    matplotlib.use("Agg")
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module(name)


def simulate_gpt3_tp2_pp2(out: Path) -> None:
    """memsim simulate of GPT-3 1.3B on 8 GPUs, TP2 PP2, into `out`: two rank classes,
    whose first ranks are 0 and 4. Raises AssertionError with memsim's stderr on failure."""
    result = subprocess.run(
        [str(BINARY), "simulate", "--model", "gpt3-1.3b", "--world-size", "8", "--tp", "2",
         "--pp", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise AssertionError(f"memsim simulate failed: {result.stderr}")


def run_cli(*args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs `memsim_plots.py args...` with this interpreter."""
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def trace_iteration(samples: list[tuple[float, float]], peak: float | None = None,
                    static: float | None = None, theory: float | None = None) -> dict:
    """One iteration of a Megatron-schema trace from (timestamp_s, allocated_MB) samples;
    reserved is allocated rounded up to 512 MiB. Optional fields are left out when None."""
    entry: dict[str, Any] = {"samples": [
        {"timestamp_s": t, "reserved_memory_MB": -(-mb // 512) * 512, "allocated_memory_MB": mb}
        for t, mb in samples]}
    for key, value in (("peak_allocated_MB", peak), ("static_memory_MB", static),
                       ("theoretical_memory_MB", theory)):
        if value is not None:
            entry[key] = value
    return entry


def files_under(folder: Path) -> set[str]:
    """Every file and folder under `folder` (hidden ones too), relative to it."""
    if not folder.exists():
        return set()
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _output(result: subprocess.CompletedProcess) -> str:
    return f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


class CliTestCase(unittest.TestCase):
    """A test with a private temporary folder and assertions on CLI results."""

    def setUp(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="memsim_plots_test_"))
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def run_ok(self, *args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess:
        result = run_cli(*args, cwd=cwd)
        self.assertEqual(result.returncode, 0, _output(result))
        self.assertNotIn("Traceback", result.stderr)
        return result

    def assert_bad_input(self, result: subprocess.CompletedProcess, command: str,
                         *mentions: Any) -> None:
        """Exit code 2 and exactly one stderr line `memsim <command>: ...` naming each of
        `mentions` (usually the offending file)."""
        self.assertEqual(result.returncode, 2, _output(result))
        lines = result.stderr.splitlines()
        self.assertEqual(len(lines), 1, f"expected one stderr line, got:\n{result.stderr}")
        self.assertTrue(lines[0].startswith(f"memsim {command}: "), lines[0])
        for mention in mentions:
            self.assertIn(str(mention), lines[0])

    def assert_png(self, path: Path, min_width: int = 100, min_height: int = 100) -> np.ndarray:
        """A readable PNG of at least the given size with a drawing on it: more than one
        colour and at least 1% of pixels differing from the background (top-left)."""
        self.assertTrue(path.is_file(), f"{path} missing")
        image = matplotlib.image.imread(path)
        height, width = image.shape[:2]
        self.assertGreaterEqual(width, min_width, path)
        self.assertGreaterEqual(height, min_height, path)
        pixels = image.reshape(-1, image.shape[2])
        self.assertGreater(len(np.unique(pixels, axis=0)), 1, f"{path} is one colour")
        differs = np.any(np.abs(pixels - pixels[0]) > 0.05, axis=1).mean()
        self.assertGreater(differs, 0.01, f"{path} is nearly blank")
        return image
