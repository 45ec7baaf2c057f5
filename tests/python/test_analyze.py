"""memsim analyze: a snapshot's numbers must equal the ones computed here by hand from
the same snapshot; the run folder, its files and the `latest` link; bad snapshots are one
stderr line and exit code 2 with nothing left behind."""

from __future__ import annotations

import collections
import json
import os
import pickle
import shutil
import tempfile
import unittest
from pathlib import Path

from .helpers import MB, CliTestCase, files_under, run_cli

FIGURES = ["category_breakdown.png", "memory_efficiency.png", "memory_overview.png",
           "size_distribution.png", "top_consumers.png"]
RUN_DIR_FILES = sorted(FIGURES + ["README.md", "analysis_report.txt"])


def frame(filename: str, name: str, line: int = 1) -> dict:
    return {"filename": filename, "line": line, "name": name}


def memsim_frames(module: str, op: str, category: str, phase: str, tensor: str) -> list:
    """The three frames memsim writes per block (simulator/snapshot_writer.h)."""
    return [frame(module, op, 0), frame(f"memsim://category/{category}", f"{phase} iteration=1 "
                                        "microbatch=0", 1), frame("memsim://tensor", tensor, 0)]


# (MB, state, frames, the category a person assigns from the frames)
KEYWORD_BLOCKS = [
    (512, "active_allocated", [frame("megatron/core/transformer/moe/experts.py", "forward"),
                               frame("megatron/core/transformer/attention.py", "forward")],
     "Expert/MoE"),  # both match: Expert/MoE comes first
    (256, "active_allocated", [frame("model/attention.py", "core_attention"),
                               frame("torch/nn/functional.py", "linear")], "Attention"),
    (128, "active_pending_free", [frame("torch/nn/functional.py", "linear")], "Linear/MatMul"),
    (64, "active_allocated", [frame("torch/optim/adam.py", "_init_group")], "Optimizer State"),
    (32, "active_allocated", [frame("torch/distributed/comm.py", "broadcast")],
     "Communication"),  # "comm" contains "mm" but is not a matmul
    (16, "active_allocated", [frame("torch/distributed/fsdp/_flat_param.py", "flatten")], "FSDP"),
    (8, "active_allocated", [frame("megatron/core/grad_buffer.py", "allocate")], "Gradient"),
    (4, "active_allocated", [frame("torch/autograd/__init__.py", "run_engine")],
     "Unknown"),  # "autograd" is not a gradient keyword
    (2, "active_allocated", [], "Unknown"),
]

MEMSIM_BLOCKS = [
    (300, "active_allocated", memsim_frames("decoder.layers.0.self_attention.linear_qkv",
                                            "aten::mm", "parameters", "setup", "BFloat16[3, 4]"),
     "Parameters"),  # the module says attention/linear; memsim's category wins
    (200, "active_allocated", memsim_frames("decoder.layers.0.mlp", "aten::gelu", "activations",
                                            "forward", "BFloat16[2, 4]"), "Activations"),
    (100, "active_allocated", memsim_frames("optimizer", "aten::empty_strided", "optimizer_state",
                                            "optimizer", "Float[4]"), "Optimizer State"),
    (50, "active_allocated", memsim_frames("ddp.grad_buffer", "aten::empty", "gradients", "setup",
                                           "Float[8]"), "Gradients"),
    (20, "active_allocated", memsim_frames("<top>", "aten::mm", "temporaries", "backward",
                                           "Float[2]"), "Temporaries"),
    (10, "active_allocated", memsim_frames("<top>", "aten::empty", "communication", "forward",
                                           "Float[1]"), "Communication"),
    (5, "active_allocated", memsim_frames("<top>", "aten::empty", "unattributed", "setup",
                                          "Float[1]"), "Unknown"),
]


def snapshot_dict(blocks: list, free_mb: list[int], empty_segment_mb: int) -> dict:
    """PyTorch 2.x layout: the active blocks in one large segment followed by free blocks
    of the given sizes, plus one small segment with nothing allocated."""
    address = 1 << 40
    entries = []
    for mb, state, frames, _ in blocks:
        entries.append({"address": address, "size": mb * MB, "requested_size": mb * MB - MB // 2,
                        "state": state, "frames": frames})
        address += mb * MB
    for mb in free_mb:
        entries.append({"address": address, "size": mb * MB, "requested_size": 0,
                        "state": "inactive", "frames": []})
        address += mb * MB
    large = {"device": 0, "address": 1 << 40, "total_size": sum(b["size"] for b in entries),
             "segment_type": "large", "blocks": entries, "frames": []}
    small = {"device": 0, "address": 1 << 41, "total_size": empty_segment_mb * MB,
             "segment_type": "small", "frames": [],
             "blocks": [{"address": 1 << 41, "size": empty_segment_mb * MB, "state": "inactive",
                         "frames": []}]}
    return {"segments": [large, small], "device_traces": [[]], "allocator_settings": {}}


def write_pickle(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(data, protocol=2))
    return path


def section(report: str, heading: str) -> list[str]:
    """The lines under `== heading` up to the next blank line."""
    lines = report.split(f"== {heading}\n", 1)[1].split("\n\n", 1)[0]
    return lines.splitlines()


def expected_totals(snapshot: dict) -> tuple[int, int]:
    """(allocated, reserved) by the definitions: active blocks, segment sizes."""
    segments = snapshot["segments"] if isinstance(snapshot, dict) else snapshot
    allocated = sum(b["size"] for s in segments for b in s["blocks"]
                    if b["state"].startswith("active"))
    return allocated, sum(s["total_size"] for s in segments)


class AnalyzeTest(CliTestCase):
    """A keyword-categorized snapshot analyzed once; the tests read the results."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = Path(tempfile.mkdtemp(prefix="memsim_plots_test_"))
        cls.snapshot = snapshot_dict(KEYWORD_BLOCKS, free_mb=[150, 2], empty_segment_mb=20)
        cls.path = write_pickle(cls.tmp / "outputs" / "iteration_1" /
                                "rank0_memory_snapshot.pickle", cls.snapshot)
        cls.results = cls.tmp / "results"
        cls.result = run_cli("analyze", cls.path, cls.results, "--dpi", 40)
        cls.run_dir = cls.results / os.readlink(cls.results / "latest")
        cls.report = (cls.run_dir / "analysis_report.txt").read_text()

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_succeeds_quietly(self) -> None:
        self.assertEqual(self.result.returncode, 0, self.result.stderr)
        self.assertEqual(self.result.stderr, "")

    def test_run_folder_is_named_from_the_path_and_linked(self) -> None:
        self.assertRegex(self.run_dir.name, r"^\d{8}_\d{6}_iter1_rank0$")
        self.assertTrue((self.results / "latest").is_symlink())
        self.assertEqual(files_under(self.results),
                         {"latest", self.run_dir.name,
                          *(f"{self.run_dir.name}/{f}" for f in RUN_DIR_FILES)})

    def test_figures(self) -> None:
        for name in FIGURES:
            self.assert_png(self.run_dir / name)

    def test_totals_match_the_snapshot(self) -> None:
        allocated, reserved = expected_totals(self.snapshot)
        self.assertEqual(allocated, (512 + 256 + 128 + 64 + 32 + 16 + 8 + 4 + 2) * MB)
        self.assertEqual(reserved, allocated + (150 + 2 + 20) * MB)
        lines = section(self.report, "Memory efficiency")
        self.assertIn(f"Reserved:   {reserved / 2**30:,.2f} GiB ({reserved} bytes)", lines)
        self.assertIn(f"Allocated:  {allocated / 2**30:,.2f} GiB ({allocated} bytes)", lines)
        wasted = reserved - allocated
        self.assertIn(f"Cache/fragmentation (reserved - allocated): {wasted / 2**30:,.2f} GiB "
                      f"({wasted} bytes)", lines)
        self.assertIn(f"Cache efficiency (allocated / reserved): {allocated / reserved * 100:.2f}% (poor)",
                      lines)

    def test_categories_match_the_frames(self) -> None:
        assert_categories(self, self.report, KEYWORD_BLOCKS)

    def test_largest_allocations_in_order(self) -> None:
        lines = section(self.report, "Largest allocations (top 50)")[1:]
        self.assertEqual(len(lines), len(KEYWORD_BLOCKS))
        sizes = [float(line.split()[1].replace(",", "")) for line in lines]
        self.assertEqual(sizes, [float(b[0]) for b in KEYWORD_BLOCKS])
        self.assertIn("forward (experts.py:1)", lines[0])

    def test_fragmentation_and_recommendations(self) -> None:
        fragmentation = "\n".join(section(self.report, "Fragmentation analysis"))
        self.assertIn("Cached free blocks: 3, 172.0 MiB in total", fragmentation)
        self.assertIn("Largest free block: 150.0 MiB", fragmentation)
        self.assertIn("(size - requested): 4.5 MiB", fragmentation)  # 9 blocks, 0.5 MiB each
        recommendations = self.report.split("== Recommendations\n", 1)[1]
        self.assertIn("High cache overhead", recommendations)
        self.assertIn("1 cached free block(s) of 100 MiB or more", recommendations)
        self.assertIn("1 segment(s) (0.02 GiB) hold no live allocation", recommendations)

    def test_readme(self) -> None:
        readme = (self.run_dir / "README.md").read_text()
        self.assertTrue(readme.startswith("# Memory snapshot analysis: iter1_rank0"))
        self.assertIn("High cache overhead", readme)
        self.assertIn("- Expert/MoE: 0.50 GiB", readme)


def assert_categories(test: unittest.TestCase, report: str, blocks: list) -> None:
    """The report's category table equals the totals of the hand-assigned categories."""
    expected_mb: dict[str, int] = collections.Counter()
    expected_count: dict[str, int] = collections.Counter()
    for mb, _, _, category in blocks:
        expected_mb[category] += mb
        expected_count[category] += 1
    allocated = sum(expected_mb.values())
    rows = {}
    for line in section(report, "Memory by category")[1:]:
        name, mb, pct, count = line.rsplit(None, 3)
        rows[name.strip()] = (mb, pct, int(count))
    test.assertEqual(rows, {c: (f"{mb:,.1f}", f"{mb / allocated * 100:.1f}%", expected_count[c])
                            for c, mb in expected_mb.items()})


class AnalyzeFormatsTest(CliTestCase):
    def test_memsim_snapshot_uses_exact_categories(self) -> None:
        snapshot = snapshot_dict(MEMSIM_BLOCKS, free_mb=[1], empty_segment_mb=2)
        path = write_pickle(self.tmp / "memsim_out" / "snapshot_rank0.pickle", snapshot)
        self.run_ok("analyze", path, "--dpi", 40, cwd=self.tmp)  # RESULTS_DIR: ./results
        run_dir = self.tmp / "results" / "latest"
        self.assertRegex(os.readlink(run_dir), r"^\d{8}_\d{6}_snapshot_rank0$")
        report = (run_dir / "analysis_report.txt").read_text()
        self.assertIn("memsim snapshot: exact categories", report)
        assert_categories(self, report, MEMSIM_BLOCKS)
        allocated, reserved = expected_totals(snapshot)
        self.assertIn(f"Cache efficiency (allocated / reserved): {allocated / reserved * 100:.2f}% "
                      "(excellent)", report)
        self.assertIn("decoder.layers.0.self_attention.linear_qkv aten::mm BFloat16[3, 4]", report)
        self.assertIn("1 backward allocation(s)", report)  # the temporary

    def test_out_of_memory_gets_measured_advice_not_empty_cache(self) -> None:
        """A snapshot of a run that ran out of memory: empty_cache() cannot help (PyTorch
        already released the cache and retried); the advice memsim measured is shown, and
        the GPU's use is reported against its usable memory, not called efficient."""
        snapshot = snapshot_dict(MEMSIM_BLOCKS, free_mb=[150], empty_segment_mb=2)
        out = self.tmp / "memsim_out"
        path = write_pickle(out / "snapshot_rank3_peak.pickle", snapshot)  # memsim names it so
        allocated, reserved = expected_totals(snapshot)
        usable_mb = 1000.0
        (out / "summary_rank3.json").write_text(json.dumps({
            "gpu_usable_MB": usable_mb, "out_of_memory": "Out of memory on stage 1 ...",
            "advice": [{"change": "--recompute full", "effect": "...", "peak_reserved_MB": 512.0,
                        "fits": True, "step_time_ratio": 1.25}]}))
        self.run_ok("analyze", path, self.tmp / "results", "oom", "--dpi", 30)
        report = (self.tmp / "results" / "latest" / "analysis_report.txt").read_text()
        self.assertNotIn("empty_cache() would", report)
        self.assertNotIn("empty_cache() returns", report)
        self.assertIn("torch.cuda.empty_cache() cannot help", report)
        self.assertIn("Measured by memsim: --recompute full gives a peak of 0.50 GiB (fits), "
                      "step time +25.0%.", report)
        self.assertIn(f"GPU use (reserved / usable): {reserved / (usable_mb * MB) * 100:.1f}% of "
                      f"{usable_mb / 1024:,.2f} GiB", report)
        # The same snapshot with no verdict beside it: the cache advice stays.
        alone = write_pickle(self.tmp / "alone" / "snapshot.pickle", snapshot)
        self.run_ok("analyze", alone, self.tmp / "results", "alone", "--dpi", 30)
        report = (self.tmp / "results" / "latest" / "analysis_report.txt").read_text()
        self.assertIn("empty_cache() would release them", report)
        self.assertNotIn("cannot help", report)

    def test_expandable_segments_are_not_advised_again(self) -> None:
        snapshot = snapshot_dict(KEYWORD_BLOCKS, free_mb=[150, 20, 2], empty_segment_mb=20)
        for segment in snapshot["segments"]:
            segment["is_expandable"] = True
        path = write_pickle(self.tmp / "expandable.pickle", snapshot)
        self.run_ok("analyze", path, self.tmp / "results", "expandable", "--dpi", 30)
        report = (self.tmp / "results" / "latest" / "analysis_report.txt").read_text()
        self.assertIn("High cache overhead", report)
        self.assertIn("The segments are already expandable: try fewer distinct tensor sizes.",
                      report)
        self.assertNotIn("expandable_segments:True", report)

    def test_old_list_format_with_history(self) -> None:
        segments = snapshot_dict(KEYWORD_BLOCKS[:3], free_mb=[], empty_segment_mb=1)["segments"]
        for block in segments[0]["blocks"]:
            frames = block.pop("frames")
            block.pop("requested_size")
            block["history"] = [{"addr": block["address"], "real_size": 1, "frames": []},
                                {"addr": block["address"], "real_size": 1, "frames": frames}]
        path = write_pickle(self.tmp / "old.pickle", segments)
        self.run_ok("analyze", path, self.tmp / "results", "old_format", "--dpi", 40)
        run_dir = self.tmp / "results" / "latest"
        self.assertTrue(os.readlink(run_dir).endswith("_old_format"))
        report = (run_dir / "analysis_report.txt").read_text()
        assert_categories(self, report, KEYWORD_BLOCKS[:3])
        allocated, reserved = expected_totals(segments)
        self.assertIn(f"({allocated} bytes)", report)
        self.assertIn("Rounding inside allocations (size - requested): 0.0 MiB", report)

    def test_second_run_moves_latest(self) -> None:
        path = write_pickle(self.tmp / "s.pickle", snapshot_dict(KEYWORD_BLOCKS[:2], [], 1))
        results = self.tmp / "results"
        self.run_ok("analyze", path, results, "first", "--dpi", 30)
        self.run_ok("analyze", path, results, "second", "--dpi", 30)
        runs = sorted(p.name for p in results.iterdir() if p.name != "latest")
        self.assertEqual(len(runs), 2)
        self.assertTrue(runs[0].endswith("_first") and runs[1].endswith("_second"), runs)
        self.assertEqual(os.readlink(results / "latest"), runs[1])
        self.assertFalse([f for f in files_under(results) if f.startswith(".")])

    def test_help_names_the_memsim_command(self) -> None:
        result = run_cli("analyze", "--help")
        self.assertEqual(result.returncode, 0)
        self.assertTrue(result.stdout.startswith("usage: memsim analyze"), result.stdout)


class AnalyzeBadInputTest(CliTestCase):
    """Exit 2, one line naming the snapshot, and no results folder."""

    def assert_fails(self, path: Path, *mentions) -> None:
        results = self.tmp / "results"
        self.assert_bad_input(run_cli("analyze", path, results), "analyze", path, *mentions)
        self.assertFalse(results.exists(), "results left behind")

    def good_bytes(self) -> bytes:
        return pickle.dumps(snapshot_dict(KEYWORD_BLOCKS, [1], 1), protocol=2)

    def test_truncated_pickle(self) -> None:
        path = self.tmp / "rank0.pickle"
        path.write_bytes(self.good_bytes()[:200])
        self.assert_fails(path, "truncated or corrupt")

    def test_corrupt_pickle(self) -> None:
        path = self.tmp / "rank0.pickle"
        path.write_bytes(b"\x80\x02}q\x00(X\x08\x00\x00\x00segments\xff\xfe garbage")
        self.assert_fails(path, "truncated or corrupt")

    def test_not_a_pickle(self) -> None:
        path = self.tmp / "rank0.pickle"
        path.write_text('{"segments": []}')
        self.assert_fails(path, "not a readable snapshot pickle")

    def test_no_segments(self) -> None:
        self.assert_fails(write_pickle(self.tmp / "empty.pickle", {"segments": []}), "no segments")
        self.assert_fails(write_pickle(self.tmp / "empty_list.pickle", []), "no segments")

    def test_zero_reserved(self) -> None:
        path = write_pickle(self.tmp / "zero.pickle",
                            {"segments": [{"total_size": 0, "blocks": []}]})
        self.assert_fails(path, "0 bytes")

    def test_segment_without_size(self) -> None:
        path = write_pickle(self.tmp / "bad.pickle", {"segments": [{"blocks": []}]})
        self.assert_fails(path, "total_size")

    def test_not_a_snapshot(self) -> None:
        self.assert_fails(write_pickle(self.tmp / "other.pickle", {"weights": [1, 2]}),
                          "not a PyTorch memory snapshot")

    def test_pickled_class_is_refused(self) -> None:
        path = write_pickle(self.tmp / "class.pickle",
                            collections.OrderedDict(segments=[]))
        self.assert_fails(path, "collections.OrderedDict")

    def test_missing_file(self) -> None:
        self.assert_fails(self.tmp / "nowhere.pickle", "cannot read")

    # Found by tests/fuzz/fuzz_python_readers.py (the inputs are kept in its seeds): a few
    # bytes of pickle that ask for gigabytes.
    def test_memo_index_that_asks_for_gigabytes(self) -> None:
        path = self.tmp / "memo.pickle"  # LONG_BINPUT 2^31 - 1: a memo table that large
        path.write_bytes(b"\x80\x02]r\xff\xff\xff\x7f.")
        self.assert_fails(path, "takes more memory than a snapshot of its size can need")

    def test_bytearray_of_exabytes_is_one_line(self) -> None:
        path = self.tmp / "bytearray.pickle"  # BYTEARRAY8 of 2^62 bytes
        path.write_bytes(b"\x80\x05\x96" + (2**62).to_bytes(8, "little") + b".")
        self.assert_fails(path, "takes more memory than a snapshot of its size can need")

    def test_lists_shared_over_and_over(self) -> None:
        # 1,000 references to one segment of 1,000 references to one block of 1,000 frames:
        # a billion frames to walk from 6 KB of pickle.
        block = {"size": 512, "state": "active_allocated",
                 "frames": [frame("model.py", "forward")] * 1000}
        segment = {"total_size": 512 * 1000, "blocks": [block] * 1000}
        path = write_pickle(self.tmp / "shared.pickle", {"segments": [segment] * 1000})
        self.assert_fails(path, "shared by reference over and over")

    def test_latest_that_is_a_folder(self) -> None:
        path = self.tmp / "ok.pickle"
        path.write_bytes(self.good_bytes())
        results = self.tmp / "results"
        (results / "latest").mkdir(parents=True)
        result = run_cli("analyze", path, results)
        self.assert_bad_input(result, "analyze", results / "latest", "not a symlink")
        self.assertEqual(files_under(results), {"latest"})


if __name__ == "__main__":
    unittest.main()
