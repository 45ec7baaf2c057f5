"""memsim compare: per-rank plots, the summary CSV and the peak overview from real and
simulated traces; bad input is one stderr line and exit code 2 with no output left."""

from __future__ import annotations

import csv
import unittest

from .helpers import CliTestCase, run_cli, trace_iteration, write_json

# The last iteration is "10": a string sort would pick "9", whose peaks differ.
REAL = {
    0: {"9": trace_iteration([(5.0, 100.0), (5.5, 900.0)], peak=900.0, static=90.0),
        "10": trace_iteration([(20.0, 300.0), (20.4, 1500.0), (20.9, 1200.0)], peak=1600.0,
                              static=300.0, theory=2000.0)},
    1: {"10": trace_iteration([(3.0, 200.0), (3.5, 700.0)], peak=750.0, static=200.0)},
}
SIM = {
    0: {"9": trace_iteration([(0.0, 100.0), (0.2, 800.0)], peak=800.0, static=80.0),
        "10": trace_iteration([(1.0, 310.0), (1.3, 1400.0), (1.6, 1100.0)], peak=1500.0,
                              static=310.0, theory=-1)},
    # An old file: no static or theoretical memory, no peak_allocated_MB (max sample).
    1: {"10": trace_iteration([(0.0, 210.0), (0.1, 800.0), (0.2, 500.0)])},
    # Only simulated: warned about and skipped.
    2: {"10": trace_iteration([(0.0, 10.0), (0.1, 20.0)], peak=20.0)},
}


class CompareTest(CliTestCase):
    """One successful run shared by the checks of its outputs."""

    def setUp(self) -> None:
        super().setUp()
        self.real, self.sim, self.out = self.tmp / "real", self.tmp / "sim", self.tmp / "plots"
        for rank, trace in REAL.items():
            write_json(self.real / f"memory_trace_rank{rank}.json", trace)
        for rank, trace in SIM.items():  # the sweep naming, rank taken after "rank"
            write_json(self.sim / f"memory_trace_rank{rank}_wd8_tp1_pp1_dp8_exp1_expNumNone"
                                  f"_l2_mbs1_nmbs4_gbs32_ts7.json", trace)

    def compare(self, *extra: str):
        return run_cli("compare", "-r", self.real, "-s", self.sim, "-o", self.out,
                       "--dpi", 40, *extra)

    def test_writes_plots_summary_and_overview(self) -> None:
        result = self.compare("-t")
        self.assertEqual(result.returncode, 0, result.stderr)
        for rank in (0, 1):
            self.assert_png(self.out / f"memory_comparison_rank_{rank}.png", 300, 150)
        self.assertFalse((self.out / "memory_comparison_rank_2.png").exists())
        self.assert_png(self.out / "peak_overview.png", 200, 150)
        self.assertEqual(sorted(p.name for p in self.out.iterdir()),
                         ["comparison_summary.csv", "memory_comparison_rank_0.png",
                          "memory_comparison_rank_1.png", "peak_overview.png"])
        self.assertEqual(result.stderr.count("\n"), 1)
        self.assertIn("warning: rank 2 has a simulated trace", result.stderr)
        self.assertIn("real peak MiB", result.stdout)

        with open(self.out / "comparison_summary.csv", newline="") as f:
            rows = {int(row["rank"]): row for row in csv.DictReader(f)}
        self.assertEqual(sorted(rows), [0, 1])
        self.assertEqual(list(rows[0]), ["rank", "real_peak_MB", "sim_peak_MB", "abs_error_MB",
                                         "rel_error_pct", "real_static_MB", "sim_static_MB",
                                         "static_error_MB"])
        self.assertEqual(float(rows[0]["real_peak_MB"]), 1600.0)
        self.assertEqual(float(rows[0]["sim_peak_MB"]), 1500.0)
        self.assertEqual(float(rows[0]["abs_error_MB"]), 100.0)
        self.assertAlmostEqual(float(rows[0]["rel_error_pct"]), -6.25)
        self.assertEqual(float(rows[0]["real_static_MB"]), 300.0)
        self.assertEqual(float(rows[0]["sim_static_MB"]), 310.0)
        self.assertEqual(float(rows[0]["static_error_MB"]), 10.0)
        self.assertEqual(float(rows[1]["real_peak_MB"]), 750.0)
        self.assertEqual(float(rows[1]["sim_peak_MB"]), 800.0)  # the largest sample
        self.assertAlmostEqual(float(rows[1]["rel_error_pct"]), 50 / 750 * 100)
        self.assertEqual(rows[1]["sim_static_MB"], "")
        self.assertEqual(rows[1]["static_error_MB"], "")

    def test_theoretical_lines_only_on_request(self) -> None:
        self.assertEqual(self.compare().returncode, 0)
        without = (self.out / "memory_comparison_rank_0.png").read_bytes()
        self.assertEqual(self.compare("--show-theoretical").returncode, 0)
        self.assertNotEqual(without, (self.out / "memory_comparison_rank_0.png").read_bytes())

    def test_help_names_the_memsim_command(self) -> None:
        result = run_cli("compare", "--help")
        self.assertEqual(result.returncode, 0)
        self.assertTrue(result.stdout.startswith("usage: memsim compare"), result.stdout)


class CompareBadInputTest(CliTestCase):
    """Each problem: exit 2, one line naming the file or folder, nothing written."""

    def setUp(self) -> None:
        super().setUp()
        self.real, self.sim, self.out = self.tmp / "real", self.tmp / "sim", self.tmp / "plots"
        write_json(self.real / "memory_trace_rank0.json", REAL[0])
        write_json(self.sim / "memory_trace_rank0.json", SIM[0])

    def compare(self):
        return run_cli("compare", "-r", self.real, "-s", self.sim, "-o", self.out, "--dpi", 40)

    def assert_fails(self, *mentions) -> None:
        self.assert_bad_input(self.compare(), "compare", *mentions)
        self.assertFalse(self.out.exists(), "output folder left behind")

    def test_missing_folder(self) -> None:
        self.real = self.tmp / "nowhere"
        self.assert_fails(self.real, "does not exist")

    def test_empty_folder(self) -> None:
        (self.sim / "memory_trace_rank0.json").unlink()
        self.assert_fails(self.sim, "memory_trace_rank*.json")

    def test_ranks_that_do_not_match(self) -> None:
        (self.sim / "memory_trace_rank0.json").rename(self.sim / "memory_trace_rank3.json")
        self.assert_fails("no rank has both", self.real, self.sim)

    def test_name_without_rank(self) -> None:
        write_json(self.sim / "memory_trace_rankX.json", SIM[0])
        self.assert_fails(self.sim / "memory_trace_rankX.json")

    def test_truncated_json(self) -> None:
        path = self.sim / "memory_trace_rank0.json"
        path.write_text(path.read_text()[:50])
        self.assert_fails(path, "not valid JSON")

    def test_deeply_nested_json(self) -> None:
        path = self.sim / "memory_trace_rank0.json"
        path.write_text("[" * 100000 + "]" * 100000)
        self.assert_fails(path, "nested too deeply")

    def test_integer_beyond_pythons_digit_limit(self) -> None:
        path = self.sim / "memory_trace_rank0.json"
        path.write_text('{"1": ' + "9" * 5000 + "}")
        self.assert_fails(path, "not usable JSON")

    def test_not_a_trace(self) -> None:
        path = write_json(self.real / "memory_trace_rank0.json", {"samples": []})
        self.assert_fails(path, "not an iteration number")

    def test_sample_without_memory(self) -> None:
        path = write_json(self.real / "memory_trace_rank0.json",
                          {"1": {"samples": [{"timestamp_s": 0.0}]}})
        self.assert_fails(path, "allocated_memory_MB")

    def test_last_iteration_without_samples(self) -> None:
        path = write_json(self.sim / "memory_trace_rank0.json",
                          {"1": {"samples": [], "peak_allocated_MB": 5.0}})
        self.assert_fails(path, "no samples")

    def test_existing_output_is_left_alone(self) -> None:
        self.out.mkdir()
        (self.out / "keep.txt").write_text("old")
        (self.sim / "memory_trace_rank0.json").write_text("{")
        self.assert_bad_input(self.compare(), "compare", self.sim / "memory_trace_rank0.json")
        self.assertEqual([p.name for p in self.out.iterdir()], ["keep.txt"])

    def test_output_folder_that_is_a_file(self) -> None:
        self.out.write_text("not a folder")
        self.assert_bad_input(self.compare(), "compare", self.out)
        self.assertEqual(self.out.read_text(), "not a folder")

    def test_usage_error_is_one_line(self) -> None:
        self.assert_bad_input(run_cli("compare", "-r", self.real), "compare", "--sim-dir")


if __name__ == "__main__":
    unittest.main()
