"""The entry point: help, and one-line errors for a missing or unknown command."""

from __future__ import annotations

import unittest

from .helpers import run_cli


class EntryPointTest(unittest.TestCase):
    def test_help_lists_the_commands(self) -> None:
        result = run_cli("--help")
        self.assertEqual(result.returncode, 0)
        for command in ("compare", "heatmap", "analyze", "report"):
            self.assertIn(command, result.stdout)

    def test_missing_or_unknown_command(self) -> None:
        for args, problem in (((), "no command given"), (("plot",), "unknown command 'plot'")):
            result = run_cli(*args)
            self.assertEqual(result.returncode, 2)
            self.assertEqual(result.stderr.count("\n"), 1, result.stderr)
            self.assertTrue(result.stderr.startswith(f"memsim: {problem}; usage:"), result.stderr)


if __name__ == "__main__":
    unittest.main()
