"""memsim heatmap: a TP x PP sweep's traces and logs to OUTPUT.png and OUTPUT.pdf; bad
input is one stderr line and exit code 2 with no output left."""

from __future__ import annotations

import re
import unittest
from pathlib import Path

from .helpers import (CliTestCase, files_under, plots_module, run_cli, trace_iteration,
                      write_json)

GB = 1024.0


def trace_name(rank: int, tp: int, pp: int) -> str:
    dp = 64 // (tp * pp)
    return (f"memory_trace_rank{rank}_wd64_tp{tp}_pp{pp}_dp{dp}_exp1_expNumNone_l8_mbs1"
            f"_nmbs{pp * 2}_gbs{dp * pp * 2}_ts1234.json")


def log_line(k: int, tp: int, pp: int, outcome: str) -> str:
    dp = 64 // (tp * pp)
    return (f"Config {k}: TP={tp}, PP={pp}, DP={dp}, NUM_MICBATCH={pp * 2}, "
            f"GLOBAL_BATCH_SIZE={dp * pp * 2} - {outcome}")


class HeatmapTest(CliTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.mem, self.logs = self.tmp / "traces", self.tmp / "logs"
        self.output = self.tmp / "figures" / "sweep_heatmap"
        # (tp, pp) -> per-rank peaks (MiB) and theory; rank 1 is the worst rank.
        self.peaks = {(1, 4): ([40 * GB, 50 * GB], 60 * GB), (2, 2): ([30 * GB, 35 * GB], 90 * GB),
                      (2, 4): ([20 * GB, 22 * GB], -1)}
        for (tp, pp), (peaks, theory) in self.peaks.items():
            for rank, peak in enumerate(peaks):
                # The first iteration peaks highest (warm-up): a layout's peak is the
                # largest of any iteration, not the last one's.
                write_json(self.mem / trace_name(rank * pp, tp, pp), {
                    "0": trace_iteration([(0.0, peak / 2), (0.5, peak)], peak=peak, theory=theory),
                    "1": trace_iteration([(1.0, peak / 3), (1.5, peak * 0.75)], peak=peak * 0.75,
                                         theory=theory)})
        # A layout the simulator predicted out of memory: trace and reason both give a peak;
        # the trace's (allocated, as in every other cell) is shown, not the reason's
        # (reserved).
        write_json(self.mem / trace_name(0, 1, 2), {"0": trace_iteration([(0.0, 95 * GB)])})
        self.successful = [log_line(1, 1, 4, "SUCCESS"), log_line(2, 2, 2, "SUCCESS"),
                           log_line(3, 2, 4, "SUCCESS")]
        self.failed = [
            "Sweep started 2025-07-26",  # not a Config line: skipped
            log_line(4, 1, 2, "FAILED (predicted out of memory: peak 97792.0 MB > allocator "
                              "capacity 81047.0 MB)"),
            log_line(5, 1, 1, "FAILED"),
            log_line(6, 3, 2, "FAILED (invalid layout: TP=3 does not divide 32 attention heads)"),
        ]
        self.write_logs()

    def write_logs(self) -> None:
        self.logs.mkdir(exist_ok=True)
        (self.logs / "successful_configs.log").write_text("\n".join(self.successful) + "\n")
        (self.logs / "failed_configs.log").write_text("\n".join(self.failed) + "\n")

    def heatmap(self, *extra):
        return run_cli("heatmap", "--memory-dir", self.mem, "--log-dir", self.logs,
                       "--output", self.output, "--dpi", 40, *extra)

    def layouts(self, stdout: str) -> dict[tuple[int, int], str]:
        return {(int(m[1]), int(m[2])): m[3]
                for m in re.finditer(r"^TP=(\d+) PP=(\d+): (.*)$", stdout, re.MULTILINE)}

    def test_writes_png_and_pdf(self) -> None:
        result = self.heatmap()
        self.assertEqual(result.returncode, 0, result.stderr)
        image = self.assert_png(Path(f"{self.output}.png"), 200, 80)
        height, width = image.shape[:2]
        self.assertGreater(width / height, 2.0, "the default figure is about 3:1")
        self.assertTrue(Path(f"{self.output}.pdf").read_bytes().startswith(b"%PDF"))
        self.assertEqual(files_under(self.output.parent),
                         {"sweep_heatmap.png", "sweep_heatmap.pdf"})

    def test_cells_take_the_worst_rank_and_log_status(self) -> None:
        result = self.heatmap()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.layouts(result.stdout), {
            (1, 1): "failed",
            (1, 2): "failed, memsim peak 95.0 GiB",
            (1, 4): "successful, peak 50.0 GiB, theory 60.0 GiB",
            (2, 2): "successful, peak 35.0 GiB, theory 90.0 GiB",
            (2, 4): "successful, peak 22.0 GiB",
            (3, 2): "invalid (TP=3 does not divide 32 attention heads)",
        })

    def test_pruned_layout_shows_its_setup(self) -> None:
        # memsim sweep --prune: no trace, the reason gives the setup's memory (MiB).
        self.failed.append(log_line(7, 4, 4, "FAILED (pruned (not simulated): parameters, "
                                             "gradient buffers and master weights alone take "
                                             "102400.0 MB on stage 0, over the 81047.0 MB "
                                             "the allocator can reserve)"))
        self.write_logs()
        result = self.heatmap()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.layouts(result.stdout)[(4, 4)],
                         "failed, pruned: setup alone 100.0 GiB")

    def test_a_failed_layout_without_a_trace_says_its_number_is_the_logs(self) -> None:
        (self.mem / trace_name(0, 1, 2)).unlink()
        result = self.heatmap()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.layouts(result.stdout)[(1, 2)],
                         "failed, log: peak reserved 95.5 GiB")

    def test_invalid_layouts_look_different_from_out_of_memory_ones(self) -> None:
        def png(name: str) -> Path:
            self.output = self.tmp / name / "sweep_heatmap"
            self.assertEqual(self.heatmap().returncode, 0)
            return Path(f"{self.output}.png")

        invalid = self.assert_png(png("invalid"), 200, 80)
        # The same sweep with TP=3 PP=2 out of memory instead of invalid.
        self.failed[-1] = log_line(6, 3, 2, "FAILED (predicted out of memory)")
        self.write_logs()
        oom = self.assert_png(png("oom"), 200, 80)
        self.assertNotEqual(invalid.shape, oom.shape)  # the footnote adds a line below
        self.failed[-1] = log_line(6, 3, 2, "FAILED (invalid layout: another rule)")
        self.failed.append(log_line(8, 3, 4, "FAILED (invalid layout: TP=3 does not divide "
                                             "32 attention heads)"))
        self.write_logs()
        result = self.heatmap()
        self.assertEqual(self.layouts(result.stdout)[(3, 4)],
                         "invalid (TP=3 does not divide 32 attention heads)")
        heatmap = plots_module("heatmap")
        grid, _ = heatmap.read_traces(self.mem)
        heatmap.read_logs(self.logs, grid)
        self.assertEqual(heatmap.invalid_rules(grid),  # one footnote per distinct rule
                         ["another rule", "TP=3 does not divide 32 attention heads"])
        self.assertEqual([heatmap._footnote_mark(i) for i in (0, 1, 25, 26, 27)],
                         ["a", "b", "z", "aa", "ab"])

    def test_title_names_model_gpu_and_world_size(self) -> None:
        heatmap = plots_module("heatmap")
        self.assertEqual(heatmap.default_title(self.logs, {64}), "TP \u00d7 PP sweep on 64 GPUs")
        write_json(self.logs / "sweep_results.json", [
            {"run": "gpt3-485b L96 H20480 V51200 E0 on 8192xA100-80GB fp16 gbs 2048 ddp "
                    "iterations 2"}] * 2)
        self.assertEqual(heatmap.default_title(self.logs, {8192}),
                         "gpt3-485b on 8,192 \u00d7 A100-80GB")
        self.assertEqual(self.heatmap().returncode, 0)
        default = Path(f"{self.output}.png").read_bytes()
        self.assertEqual(self.heatmap("--title", "My sweep").returncode, 0)
        self.assertNotEqual(default, Path(f"{self.output}.png").read_bytes())

    def test_cells_name_memsim_not_actual(self) -> None:
        heatmap = plots_module("heatmap")
        grid, _ = heatmap.read_traces(self.mem)
        heatmap.read_logs(self.logs, grid)
        fig = heatmap.heatmap_figure(grid, 80.0, None, "t", heatmap.STYLES["seed"])
        texts = [t.get_text() for t in fig.axes[0].texts]
        self.assertIn("memsim: 50.0 GiB\nTheory: 60.0 GiB", texts)  # TP=1 PP=4, worst rank
        self.assertIn("memsim: 95.0 GiB", texts)  # out of memory: the trace's allocated peak
        self.assertFalse(any("Actual" in t or "pred." in t for t in texts), texts)

    def test_clean_style_differs_from_the_seed_style(self) -> None:
        self.assertEqual(self.heatmap("--style", "seed").returncode, 0)
        seed = Path(f"{self.output}.png").read_bytes()
        self.assertEqual(self.heatmap("--style", "clean").returncode, 0)
        self.assertNotEqual(seed, Path(f"{self.output}.png").read_bytes())
        self.assert_bad_input(self.heatmap("--style", "fancy"), "heatmap", "--style")

    def test_one_log_may_be_missing(self) -> None:
        (self.logs / "successful_configs.log").unlink()
        result = self.heatmap("--figsize", 5, 2, "--max-memory", 40)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.layouts(result.stdout)[(2, 2)],
                         "successful, peak 35.0 GiB, theory 90.0 GiB")
        self.assert_png(Path(f"{self.output}.png"), 100, 50)

    def test_help_names_the_memsim_command(self) -> None:
        result = run_cli("heatmap", "--help")
        self.assertEqual(result.returncode, 0)
        self.assertTrue(result.stdout.startswith("usage: memsim heatmap"), result.stdout)

    # Bad input: exit 2, one line naming the problem, no output folder created.

    def assert_fails(self, *mentions) -> None:
        self.assert_bad_input(self.heatmap(), "heatmap", *mentions)
        self.assertFalse(self.output.parent.exists(), "output left behind")

    def test_empty_memory_folder(self) -> None:
        for path in self.mem.iterdir():
            path.unlink()
        self.assert_fails(self.mem, "memory_trace_rank*.json")

    def test_trace_name_without_layout(self) -> None:
        path = write_json(self.mem / "memory_trace_rank0.json", {"0": trace_iteration([(0, 1.0)])})
        self.assert_fails(path, "_tp{T}_pp{P}_")

    def test_truncated_trace(self) -> None:
        path = self.mem / trace_name(0, 2, 2)
        path.write_text(path.read_text()[:-10])
        self.assert_fails(path, "not valid JSON")

    def test_no_logs(self) -> None:
        for path in self.logs.iterdir():
            path.unlink()
        (self.logs / "failed_configs.log").write_text("")
        self.assert_fails(self.logs / "successful_configs.log", self.logs / "failed_configs.log")

    def test_missing_log_folder(self) -> None:
        self.logs = self.tmp / "no_logs"
        self.assert_fails(self.logs, "does not exist")

    def test_grid_too_large_to_draw(self) -> None:
        for pp in range(1, 66):  # 65 PP values, one over the limit
            write_json(self.mem / trace_name(0, 1, pp + 100), {"0": trace_iteration([(0, 1.0)])})
        self.assert_fails(self.mem, "PP values, more than the 64")

    def test_unparsable_log_line(self) -> None:
        self.successful.append("Config 7: TP=two, PP=4 - SUCCESS")
        self.write_logs()
        self.assert_fails(f"{self.logs / 'successful_configs.log'}:4", "TP=two")


if __name__ == "__main__":
    unittest.main()
