"""memsim report: per-rank figures and report.txt from a memsim output folder, layers
merged and tensors grouped as computed here by hand; bad input is one stderr line and
exit code 2 with nothing left behind."""

from __future__ import annotations

import re
import unittest

from .helpers import CliTestCase, files_under, run_cli, trace_iteration, write_json


def tensor(mb: float, module: str, op: str) -> dict:
    return {"size_bytes": int(mb * 2**20), "size_MB": mb, "tensor": "BFloat16[2, 4]", "op": op,
            "module": module, "phase": "forward", "category": "activations", "iteration": 1,
            "microbatch": 0}


def summary(rank: int, **extra) -> dict:
    """A summary_rank{R}.json as memsim writes it, plus a key this tool does not know."""
    return {
        "rank": rank, "gpu": "H100-80GB", "peak_allocated_MB": 5000.0,
        "peak_reserved_MB": 5120.0, "static_memory_MB": 1500.0, "theoretical_memory_MB": -1.0,
        "peak_phase": "backward", "peak_time_s": 1.25, "gpu_usable_MB": 81047.0,
        "iterations": [{"iteration": 0, "static_memory_MB": 1000.0, "peak_allocated_MB": 4000.0,
                        "peak_reserved_MB": 4096.0, "duration_s": 1.0},
                       {"iteration": 1, "static_memory_MB": 1500.0, "peak_allocated_MB": 5000.0,
                        "peak_reserved_MB": 5120.0, "duration_s": 1.0}],
        # Written in another order than training order on purpose.
        "phases": {"optimizer": {"peak_allocated_MB": 1500.0},
                   "backward": {"peak_allocated_MB": 5000.0},
                   "forward": {"peak_allocated_MB": 4900.0},
                   "setup": {"peak_allocated_MB": 1000.0}},
        "breakdown_at_peak_MB": {"parameters": 500.0, "gradients": 500.0,
                                 "optimizer_state": 500.0, "activations": 3400.0,
                                 "temporaries": 100.0, "communication": 0.0,
                                 "allocator_rounding": 0.5},
        "modules_at_peak": [
            {"module": "decoder.layers.0.mlp", "MB": 1000.0},
            {"module": "decoder.layers.1.mlp", "MB": 900.0},
            {"module": "decoder.layers.10.self_attention.core_attention", "MB": 300.0},
            {"module": "decoder.layers.2", "MB": 20.0},
            {"module": "decoder.layers.3", "MB": 30.0},
            {"module": "embedding", "MB": 400.0},
        ],
        "largest_tensors_at_peak": [
            tensor(400.0, "decoder.layers.0.mlp", "aten::mm"),
            tensor(300.0, "decoder.layers.1.mlp", "aten::mm"),
            tensor(250.0, "decoder.layers.1.mlp", "aten::gelu"),
            tensor(200.0, "embedding", "aten::embedding"),
            tensor(100.0, "decoder.layers.7.mlp", "aten::mm"),
        ],
        "enum_names": {"phase": ["setup", "forward", "backward", "optimizer"],
                       "category": ["unattributed", "parameters", "gradients", "optimizer_state",
                                    "activations", "temporaries", "communication",
                                    "workspaces"]},
        "future_key": {"ignored": True},
        **extra,
    }


class ReportTest(CliTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.run_dir = self.tmp / "memsim_out"
        write_json(self.run_dir / "summary_rank0.json", summary(0))
        write_json(self.run_dir / "summary_rank4.json",
                   summary(4, rank_class=1, pp_stage=1, ranks=[[4, 7], [12, 12]]))
        write_json(self.run_dir / "memory_trace_rank0.json", {
            "0": trace_iteration([(0.0, 1000.0), (0.5, 4000.0)], peak=4000.0, static=1000.0),
            "1": trace_iteration([(1.0, 1500.0), (1.25, 5000.0), (1.9, 1500.0)], peak=5000.0)})

    def test_writes_figures_and_report(self) -> None:
        result = self.run_ok("report", self.run_dir, "--dpi", 40)
        out = self.run_dir / "report"
        expected = {"report.txt", "timeline_rank0.png"} | {
            f"{kind}_rank{r}.png" for kind in ("phases", "modules", "tensors") for r in (0, 4)}
        self.assertEqual(files_under(out), expected)
        for name in expected - {"report.txt"}:
            self.assert_png(out / name)
        self.assertIn("Rank 4 (H100-80GB; class 1; pipeline stage 1; stands for ranks 4-7, 12)",
                      result.stdout)

        report = (out / "report.txt").read_text()
        ranks = report.split("==== ")[1:]
        self.assertEqual(len(ranks), 2)
        for text in ranks:
            for heading in ("-- Memory by phase", "-- Memory by module",
                            "-- Tensors alive at the peak"):
                self.assertEqual(text.count(heading), 1, heading)
        self.check_rank0(ranks[0])

    def check_rank0(self, text: str) -> None:
        self.assertTrue(text.startswith("Rank 0 (H100-80GB): peak allocated 5,000.0 MiB in "
                                        "backward at t=1.250 s"), text[:200])
        self.assertNotIn("theoretical", text.splitlines()[0])  # -1: unknown
        self.assertEqual(rows(text, "Memory by phase"), [
            ["setup", "1,000.0"], ["forward", "4,900.0"], ["backward", "5,000.0"],
            ["optimizer", "1,500.0"]])
        # By hand: layers.0/1.mlp -> 1900 (2); layers.2/3 -> 50 (2); the rest alone.
        self.assertEqual(rows(text, "Memory by module"), [
            ["decoder.layers.*.mlp", "1,900.0", "2"], ["embedding", "400.0", "1"],
            ["decoder.layers.*.self_attention.core_attention", "300.0", "1"],
            ["decoder.layers.*", "50.0", "2"]])
        self.assertEqual(rows(text, "Tensors alive at the peak"), [
            ["decoder.layers.*.mlp", "aten::mm", "800.0", "3"],
            ["decoder.layers.*.mlp", "aten::gelu", "250.0", "1"],
            ["embedding", "aten::embedding", "200.0", "1"]])

    def test_output_dir_option(self) -> None:
        out = self.tmp / "elsewhere" / "report"
        self.run_ok("report", self.run_dir, "-o", out, "--dpi", 30)
        self.assertIn("report.txt", files_under(out))
        self.assertFalse((self.run_dir / "report").exists())

    def test_help_names_the_memsim_command(self) -> None:
        result = run_cli("report", "--help")
        self.assertEqual(result.returncode, 0)
        self.assertTrue(result.stdout.startswith("usage: memsim report"), result.stdout)

    # Bad input: exit 2, one line naming the file, no report folder.

    def assert_fails(self, *mentions) -> None:
        self.assert_bad_input(run_cli("report", self.run_dir), "report", *mentions)
        self.assertFalse((self.run_dir / "report").exists(), "output left behind")

    def test_no_summaries(self) -> None:
        for name in ("summary_rank0.json", "summary_rank4.json"):
            (self.run_dir / name).unlink()
        self.assert_fails(self.run_dir, "summary_rank{R}.json")

    def test_missing_run_dir(self) -> None:
        self.run_dir = self.tmp / "nowhere"
        self.assert_fails(self.run_dir, "does not exist")

    def test_truncated_summary(self) -> None:
        path = self.run_dir / "summary_rank4.json"
        path.write_text(path.read_text()[:100])
        self.assert_fails(path, "not valid JSON")

    def test_summary_without_phases(self) -> None:
        data = summary(4)
        del data["phases"]
        path = write_json(self.run_dir / "summary_rank4.json", data)
        self.assert_fails(path, "'phases'")

    def test_phases_in_the_order_the_summary_names_them(self) -> None:
        # The order comes from memsim (enum_names), not from a copy in the tool: a phase
        # this tool has never heard of sits where memsim puts it.
        data = summary(0)
        data["enum_names"]["phase"] = ["setup", "forward", "recompute", "backward", "optimizer"]
        data["phases"]["recompute"] = {"peak_allocated_MB": 4950.0}
        write_json(self.run_dir / "summary_rank0.json", data)
        self.run_ok("report", self.run_dir, "--dpi", 40)
        text = (self.run_dir / "report" / "report.txt").read_text().split("==== ")[1]
        self.assertEqual([row[0] for row in rows(text, "Memory by phase")],
                         ["setup", "forward", "recompute", "backward", "optimizer"])

    def test_summary_without_phase_names(self) -> None:
        data = summary(4)
        del data["enum_names"]
        path = write_json(self.run_dir / "summary_rank4.json", data)
        self.assert_fails(path, "'enum_names'")

    def test_summary_with_a_bad_tensor(self) -> None:
        data = summary(0)
        data["largest_tensors_at_peak"][2]["size_MB"] = "big"
        path = write_json(self.run_dir / "summary_rank0.json", data)
        self.assert_fails(path, "largest_tensors_at_peak[2]", "size_MB")

    def test_corrupt_trace(self) -> None:
        path = self.run_dir / "memory_trace_rank0.json"
        path.write_bytes(b"\x00\xff not json")
        self.assert_fails(path)


def rows(rank_text: str, heading: str) -> list[list[str]]:
    """The table rows (header dropped) under `-- heading`, split on 2+ spaces."""
    block = rank_text.split(f"-- {heading}", 1)[1].split("\n\n", 1)[0]
    lines = block.splitlines()[2:]  # the rest of the heading line, the column header
    return [re.split(r"\s{2,}", line.strip()) for line in lines if not line.startswith(
        ("static memory", "at the peak"))]


if __name__ == "__main__":
    unittest.main()
