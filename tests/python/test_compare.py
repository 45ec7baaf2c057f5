"""memsim compare: per-rank plots, the summary CSV and the peak overview from real and
simulated traces; bad input is one stderr line and exit code 2 with no output left."""

from __future__ import annotations

import csv
import unittest

from .helpers import CliTestCase, plots_module, run_cli, trace_iteration, write_json

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
        self.assertIn("warning: rank 2 has a simulated trace", result.stderr)
        self.assertIn("real peak MiB", result.stdout)

        with open(self.out / "comparison_summary.csv", newline="") as f:
            rows = {int(row["rank"]): row for row in csv.DictReader(f)}
        self.assertEqual(sorted(rows), [0, 1])
        self.assertEqual(list(rows[0]), [
            "rank", "real_peak_MB", "sim_peak_MB", "abs_error_MB", "rel_error_pct",
            "real_static_MB", "sim_static_MB", "static_error_MB", "real_static_from",
            "sim_static_from", "real_peak_time_s", "sim_peak_time_s", "peak_time_error_s",
            "real_after_forward_MB", "sim_after_forward_MB", "after_forward_error_MB",
            "real_peak_reserved_MB", "sim_peak_reserved_MB", "peak_reserved_error_MB",
            "sim_rank", "alignment"])
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
        # No static field in the simulated trace: the iteration's first sample, said so.
        self.assertEqual(float(rows[1]["sim_static_MB"]), 210.0)
        self.assertEqual(rows[1]["sim_static_from"], "first_sample")
        self.assertEqual(rows[1]["real_static_from"], "static_memory_MB")
        self.assertEqual(float(rows[1]["static_error_MB"]), 10.0)
        self.assertIn("* sim static memory of rank(s) 1 is the iteration's first sample",
                      result.stdout)
        # These short curves show no phases (rank 0: no return to the starting level
        # after the peak), so --align phases (the default) stretches them uniformly: the
        # real iteration lasts 0.9 s, the simulated 0.6 s.
        self.assertEqual(rows[0]["alignment"], "start")
        self.assertAlmostEqual(float(rows[0]["real_peak_time_s"]), 0.4)
        self.assertAlmostEqual(float(rows[0]["sim_peak_time_s"]), 0.3 * 0.9 / 0.6)
        self.assertEqual(rows[0]["real_after_forward_MB"], "")
        self.assertIn("warning: rank 0: the real curve shows no forward, backward and "
                      "optimizer phases", result.stderr)

    def test_theoretical_lines_only_on_request(self) -> None:
        self.assertEqual(self.compare().returncode, 0)
        without = (self.out / "memory_comparison_rank_0.png").read_bytes()
        self.assertEqual(self.compare("--show-theoretical").returncode, 0)
        self.assertNotEqual(without, (self.out / "memory_comparison_rank_0.png").read_bytes())

    def test_help_names_the_memsim_command(self) -> None:
        result = run_cli("compare", "--help")
        self.assertEqual(result.returncode, 0)
        self.assertTrue(result.stdout.startswith("usage: memsim compare"), result.stdout)


# A real iteration of 10 s with clear phases (Note [Phases from the curve's shape]):
# starting level 100, peak 700 at 4 s (backward starts: the first sample within 3% of the
# 600 MiB range below the peak), the last sample above 400 is at 4 s, and the first one
# after it within 10% (60 MiB) of the starting level is at 7 s (the optimizer starts).
REAL_PHASED = [(50.0, 100.0), (52.0, 400.0), (54.0, 700.0), (56.0, 400.0), (57.0, 120.0),
               (58.0, 150.0), (60.0, 100.0)]
# The same shape on a 0.6 s clock: backward at 0.2 s, optimizer at 0.3 s, end at 0.6 s.
SIM_PHASED = [(0.0, 100.0), (0.1, 400.0), (0.2, 700.0), (0.3, 100.0), (0.5, 150.0),
              (0.6, 100.0)]


class CompareAlignmentTest(CliTestCase):
    """--align, the phases found on each curve, rank classes and signed errors."""

    def setUp(self) -> None:
        super().setUp()
        self.real, self.sim, self.out = self.tmp / "real", self.tmp / "sim", self.tmp / "plots"

    def rows(self, *extra: str) -> tuple[dict[int, dict], str, str]:
        result = self.run_ok("compare", "-r", self.real, "-s", self.sim, "-o", self.out,
                             "--dpi", 40, *extra)
        with open(self.out / "comparison_summary.csv", newline="") as f:
            return {int(r["rank"]): r for r in csv.DictReader(f)}, result.stdout, result.stderr

    def write_phased(self, sim_peak: float = 700.0) -> None:
        write_json(self.real / "memory_trace_rank0.json",
                   {"3": trace_iteration(REAL_PHASED, static=100.0)})
        sim = [(t, sim_peak if mb == 700.0 else mb) for t, mb in SIM_PHASED]
        write_json(self.sim / "memory_trace_rank0.json",
                   {"3": trace_iteration(sim, static=100.0)})

    def test_phases_put_the_simulated_peak_where_the_real_one_is(self) -> None:
        self.write_phased()
        rows, stdout, stderr = self.rows("--align", "phases")
        self.assertEqual(stderr, "")
        row = rows[0]
        self.assertEqual(row["alignment"], "phases")
        self.assertEqual(float(row["real_peak_time_s"]), 4.0)
        self.assertEqual(float(row["sim_peak_time_s"]), 4.0)  # 0.2 s is the backward anchor
        self.assertEqual(float(row["peak_time_error_s"]), 0.0)
        self.assertEqual(float(row["real_after_forward_MB"]), 700.0)
        self.assertEqual(float(row["sim_after_forward_MB"]), 700.0)
        self.assertEqual(float(row["after_forward_error_MB"]), 0.0)
        self.assertIn("aligned by phases", stdout)

    def test_start_stretches_uniformly_and_none_keeps_the_simulated_clock(self) -> None:
        self.write_phased()
        rows, _, _ = self.rows("--align", "start")
        self.assertEqual(rows[0]["alignment"], "start")
        self.assertAlmostEqual(float(rows[0]["sim_peak_time_s"]), 0.2 * 10 / 0.6)
        rows, _, _ = self.rows("--align", "none")
        self.assertEqual(rows[0]["alignment"], "none")
        self.assertEqual(float(rows[0]["sim_peak_time_s"]), 0.2)
        self.assertEqual(float(rows[0]["peak_time_error_s"]), 0.2 - 4.0)

    def test_the_peak_time_is_the_first_of_near_equal_microbatch_peaks(self) -> None:
        # Real: microbatch peaks at 2 s and 6 s, the second larger by 0.05%; simulated: the
        # first larger. Both take the first (within 0.1%); a peak 1% lower does not count.
        real = [(0.0, 100.0), (2.0, 1000.0), (4.0, 100.0), (6.0, 1000.5), (8.0, 100.0),
                (10.0, 100.0)]
        sim = [(0.0, 100.0), (1.0, 990.0), (2.0, 1000.5), (4.0, 100.0), (6.0, 1000.0),
               (8.0, 100.0), (10.0, 100.0)]
        write_json(self.real / "memory_trace_rank0.json", {"3": trace_iteration(real, static=100.0)})
        write_json(self.sim / "memory_trace_rank0.json", {"3": trace_iteration(sim, static=100.0)})
        rows, _, _ = self.rows("--align", "none")
        self.assertEqual(float(rows[0]["real_peak_time_s"]), 2.0)
        self.assertEqual(float(rows[0]["sim_peak_time_s"]), 2.0)
        self.assertEqual(float(rows[0]["peak_time_error_s"]), 0.0)

    def test_peak_reserved_is_compared_where_both_traces_give_it(self) -> None:
        # trace_iteration's reserved is allocated rounded up to 512 MiB: peaks 700 and 690
        # give 1024 and 1024; a real trace without reserved samples gives no comparison.
        self.write_phased(sim_peak=690.0)
        rows, _, _ = self.rows()
        self.assertEqual(float(rows[0]["real_peak_reserved_MB"]), 1024.0)
        self.assertEqual(float(rows[0]["sim_peak_reserved_MB"]), 1024.0)
        self.assertEqual(float(rows[0]["peak_reserved_error_MB"]), 0.0)
        real = trace_iteration(REAL_PHASED, static=100.0)
        real["samples"][2]["reserved_memory_MB"] = 1536.0
        write_json(self.real / "memory_trace_rank0.json", {"3": real})
        rows, _, _ = self.rows()
        self.assertEqual(float(rows[0]["peak_reserved_error_MB"]), 1024.0 - 1536.0)
        for sample in real["samples"]:
            del sample["reserved_memory_MB"]
        write_json(self.real / "memory_trace_rank0.json", {"3": real})
        rows, _, _ = self.rows()
        self.assertEqual(rows[0]["real_peak_reserved_MB"], "")
        self.assertEqual(rows[0]["peak_reserved_error_MB"], "")
        self.assertEqual(float(rows[0]["sim_peak_reserved_MB"]), 1024.0)

    def test_an_error_that_rounds_to_zero_has_no_minus_sign(self) -> None:
        self.write_phased(sim_peak=699.99)  # -0.0014%: "-0.0" before
        rows, stdout, _ = self.rows()
        self.assertLess(float(rows[0]["rel_error_pct"]), 0)
        self.assertNotIn("-0.00", stdout)
        self.assertRegex(stdout.splitlines()[1], r"\s0\.00\s")
        self.write_phased(sim_peak=707.0)  # +1%: two decimals with the sign
        _, stdout, _ = self.rows()
        self.assertIn("+1.00", stdout.splitlines()[1])

    def test_a_real_rank_is_compared_with_its_simulated_rank_class(self) -> None:
        # memsim simulate wrote ranks 0 and 2, the first of the classes {0, 1} and {2, 3}.
        for rank in range(4):
            write_json(self.real / f"memory_trace_rank{rank}.json",
                       {"3": trace_iteration(REAL_PHASED, static=100.0 + rank)})
        for rank in (0, 2):
            write_json(self.sim / f"memory_trace_rank{rank}.json",
                       {"3": trace_iteration(SIM_PHASED, static=100.0)})
            write_json(self.sim / f"summary_rank{rank}.json", {"ranks": [[rank, rank + 1]]})
        rows, stdout, stderr = self.rows()
        self.assertEqual(stderr, "")  # no rank skipped
        self.assertEqual({r: int(row["sim_rank"]) for r, row in rows.items()},
                         {0: 0, 1: 0, 2: 2, 3: 2})
        self.assertEqual(float(rows[3]["static_error_MB"]), -3.0)
        self.assertIn("rank 1 is compared with simulated rank 0", stdout)
        for rank in range(4):
            self.assert_png(self.out / f"memory_comparison_rank_{rank}.png", 300, 150)

    def test_a_summary_without_rank_numbers_is_refused(self) -> None:
        self.write_phased()
        path = write_json(self.sim / "summary_rank0.json", {"ranks": [[0, "one"]]})
        result = run_cli("compare", "-r", self.real, "-s", self.sim, "-o", self.out)
        self.assert_bad_input(result, "compare", path, "'ranks'")
        self.assertFalse(self.out.exists())


class CompareFunctionsTest(CliTestCase):
    """The pieces of the plots, in process: phases, y range, legend placement."""

    def setUp(self) -> None:
        super().setUp()
        self.align, self.compare = plots_module("align"), plots_module("compare")

    def test_phases_of_a_curve(self) -> None:
        times, values = zip(*[(t - 50.0, mb) for t, mb in REAL_PHASED])
        phases = self.align.find_phases(list(times), list(values))
        self.assertEqual(phases.anchors(), [0.0, 4.0, 7.0, 10.0])
        self.assertEqual(phases.after_forward_mb, 700.0)
        self.assertIsNone(self.align.find_phases([0.0, 1.0, 2.0], [5.0, 5.0, 5.0]))  # flat
        self.assertIsNone(self.align.find_phases([0.0, 1.0, 2.0], [1.0, 5.0, 4.0]))  # no end

    def test_piecewise_alignment(self) -> None:
        sim_times, sim_values = map(list, zip(*SIM_PHASED))
        sim = self.align.find_phases(sim_times, sim_values)
        real = self.align.Phases(backward_s=4.0, optimizer_s=7.0, end_s=10.0,
                                 after_forward_mb=700.0)
        times, used = self.align.align_times(sim_times, sim, 10.0, real, "phases")
        self.assertEqual(used, "phases")
        # 0.1 is halfway through the forward (0..0.2 -> 0..4); 0.5 two thirds through the
        # optimizer phase (0.3..0.6 -> 7..10).
        self.assertEqual([round(t, 9) for t in times], [0.0, 2.0, 4.0, 7.0, 9.0, 10.0])
        times, used = self.align.align_times(sim_times, None, 10.0, real, "phases")
        self.assertEqual(used, "start")
        self.assertAlmostEqual(times[-1], 10.0)

    def test_y_range_is_zoomed_to_the_data(self) -> None:
        self.assertEqual(self.compare.zoomed_limits([5000.0, 5100.0]), (4992.0, 5108.0))
        self.assertEqual(self.compare.zoomed_limits([10.0, 110.0]), (2.0, 118.0))
        self.assertEqual(self.compare.zoomed_limits([1.0, 101.0]), (0.0, 109.0))

    def test_figure_zooms_and_keeps_the_legend_off_the_data(self) -> None:
        traces = plots_module("traces")
        real_path = write_json(self.tmp / "memory_trace_rank0.json",
                               {"1": trace_iteration([(t, mb + 60000) for t, mb in REAL_PHASED],
                                                     static=60100.0)})
        sim_path = write_json(self.tmp / "sim" / "memory_trace_rank0.json",
                              {"1": trace_iteration([(t, mb + 60000) for t, mb in SIM_PHASED],
                                                    static=60100.0)})
        pair = self.compare.make_pair(0, 0, traces.last_iteration(real_path),
                                      traces.last_iteration(sim_path), "phases")
        fig = self.compare.rank_figure(pair, show_theoretical=False)
        ax = fig.axes[0]
        low, high = ax.get_ylim()  # GiB: the data spans 60100..60700 MiB
        self.assertAlmostEqual(low * 1024, 60100 - 0.08 * 600)
        self.assertAlmostEqual(high * 1024, 60700 + 0.08 * 600)
        fig.canvas.draw()
        legend, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
        self.assertGreaterEqual(legend.x0, frame.x1)
        self.assertIn("GiB", ax.get_ylabel())
        self.assertIn("phases stretched", ax.get_xlabel())

    def test_peak_overview_legend_hides_no_bar(self) -> None:
        rows = [{"rank": r, "real_peak_MB": 1000.0 + r, "sim_peak_MB": 990.0 + r,
                 "rel_error_pct": -1.0} for r in range(4)]
        fig = self.compare.peak_overview(rows)
        fig.canvas.draw()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent()
        for bar in ax.patches:
            self.assertFalse(legend.overlaps(bar.get_window_extent()))
        labels = [t.get_text() for t in ax.texts]
        self.assertEqual(labels, ["-1.00%"] * 4)  # signed, two decimals


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

    def test_number_beyond_a_double(self) -> None:
        # Found by tests/fuzz/fuzz_python_readers.py: float() of a 400-digit integer raised
        # OverflowError, an internal error instead of a one-line refusal.
        path = write_json(self.sim / "memory_trace_rank0.json",
                          {"1": {"samples": [{"timestamp_s": 0.0,
                                              "allocated_memory_MB": int("9" * 400)}]}})
        self.assert_fails(path, "allocated_memory_MB", "expected a finite number")

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
