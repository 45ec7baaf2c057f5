"""memsim's snapshots opened by the readers users have (Note [Snapshot formats] in
simulator/snapshot_writer.h):

  * snapshot_rank{R}_peak.pickle by PyTorch 1.13's torch.cuda._memory_viz (Debian's
    python3-torch, the PyTorch memsim builds against): stats, segments, memory, compare;
  * snapshot_rank{R}.pickle by a reader of the current format written from its published
    description (PyTorch's "Understanding CUDA Memory Usage" page and the memory_viz
    viewer's inputs): every field where the viewer looks for it, segment actions with
    frames, and a trace that covers the whole last iteration.

The expected numbers come from memsim's own summary_rank{R}.json, written by another
writer from the same simulation.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from .helpers import simulate_gpt3_tp2_pp2
RANKS = (0, 4)  # the first ranks of the two pipeline stages


def memory_viz():
    """PyTorch's _memory_viz module; Debian's python3-torch is a test dependency
    (tools/dev.sh installs it), so its absence is a failure, not a skip."""
    try:
        from torch.cuda import _memory_viz
    except ImportError as e:
        raise AssertionError(f"PyTorch is not importable by {sys.executable} ({e}); "
                             "install Debian's python3-torch (tools/dev.sh does)") from None
    return _memory_viz


def no_flamegraph(lines: str) -> str:
    """_memory_viz's flamegraph step downloads a Perl script; the lines are the data."""
    return lines


class SnapshotTestCase(unittest.TestCase):
    """One memsim run shared by every check: GPT-3 1.3B on 8 GPUs, TP2 PP2."""

    out: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls.out = Path(tempfile.mkdtemp(prefix="memsim_snapshot_test_"))
        try:
            simulate_gpt3_tp2_pp2(cls.out)
        except AssertionError:
            shutil.rmtree(cls.out, ignore_errors=True)
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.out, ignore_errors=True)

    def summary(self, rank: int) -> dict:
        return json.loads((self.out / f"summary_rank{rank}.json").read_text())

    def snapshot(self, name: str):
        with open(self.out / name, "rb") as f:
            return pickle.load(f)


class Torch113MemoryVizTest(SnapshotTestCase):
    """PyTorch 1.13's _memory_viz on the snapshots at the peak."""

    def test_stats_command_reports_the_peak(self) -> None:
        viz = memory_viz()
        for rank in RANKS:
            result = subprocess.run(
                [sys.executable, "-m", "torch.cuda._memory_viz", "stats",
                 str(self.out / f"snapshot_rank{rank}_peak.pickle")],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr)
            peak_bytes = int(self.summary(rank)["peak_allocated_MB"] * 2**20)
            self.assertIn(f"'active_allocated': {viz.Bytes(peak_bytes)!r}", result.stdout)
            # Exactly, not just as printed: the blocks alive at the peak are the peak.
            stats = viz.stats(self.snapshot(f"snapshot_rank{rank}_peak.pickle"))
            self.assertEqual(stats["active_allocated"].value, peak_bytes)

    def test_segments_and_memory_flamegraphs_carry_memsim_frames(self) -> None:
        viz = memory_viz()
        snapshot = self.snapshot("snapshot_rank0_peak.pickle")
        stats = viz.stats(snapshot)
        for draw in (viz.segments, viz.memory):
            lines = draw(snapshot, format_flamegraph=no_flamegraph).splitlines()
            by_state: dict[str, int] = {}
            for line in lines:
                stack, size = line.rsplit(" ", 1)
                state = stack.split(";")[2 if draw is viz.segments else 1]
                by_state[state] = by_state.get(state, 0) + int(size)
                if state == "active_allocated" and not stack.endswith("<gaps>"):
                    # memsim's three frames, read from "history"
                    frames = stack.split(";")[3 if draw is viz.segments else 2:]
                    self.assertEqual(len(frames), 3, line)
                    self.assertTrue(frames[0].startswith("tensor:0:"), line)
            self.assertEqual(by_state["active_allocated"], stats["active_allocated"].value)
            self.assertEqual(sum(by_state.values()), stats["total_size"].value)
        text = viz.memory(snapshot, format_flamegraph=no_flamegraph)
        self.assertIn("decoder.layers.0.self_attention", text)  # module paths as frames
        self.assertIn(":aten::", text)  # and ops

    def test_compare_of_two_stages(self) -> None:
        viz = memory_viz()
        before = self.snapshot("snapshot_rank0_peak.pickle")
        after = self.snapshot("snapshot_rank4_peak.pickle")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # compare prints the segment lists
            lines = viz.compare(before, after, format_flamegraph=no_flamegraph).splitlines()
        self.assertIn("only_before = [", printed.getvalue())
        sizes = {"only_before": 0, "only_after": 0}
        for line in lines:
            sizes[line.split(";", 1)[0]] += int(line.rsplit(" ", 1)[1])
        # Each side's segments are the ones only it has plus the ones both have.
        keys = [{(seg["address"], seg["total_size"]) for seg in side} for side in (before, after)]
        shared = sum(seg["total_size"] for seg in before
                     if (seg["address"], seg["total_size"]) in keys[1])
        self.assertEqual(sizes["only_before"] + shared, sum(s["total_size"] for s in before))
        self.assertEqual(sizes["only_after"] + shared, sum(s["total_size"] for s in after))

    def test_the_step_snapshot_is_the_current_format_that_1_13_cannot_read(self) -> None:
        # Documented, not hidden: 1.13 iterates the dict's keys. The _peak file is for it.
        data = self.snapshot("snapshot_rank0.pickle")
        self.assertIsInstance(data, dict)
        self.assertIsInstance(self.snapshot("snapshot_rank0_peak.pickle"), list)


# The fields the current format documents and the memory_viz viewer reads.
SEGMENT_FIELDS = {"device", "address", "total_size", "allocated_size", "active_size",
                  "requested_size", "stream", "segment_type", "blocks"}
BLOCK_FIELDS = {"address", "size", "requested_size", "state", "frames"}
TRACE_FIELDS = {"action", "addr", "size", "stream", "time_us", "frames"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom"}


class CurrentFormatTest(SnapshotTestCase):
    """snapshot_rank{R}.pickle read as the current memory_viz reads it."""

    def check_frames(self, frames: object, where: str) -> None:
        self.assertIsInstance(frames, list, where)
        for frame in frames:
            self.assertEqual(set(frame), {"filename", "line", "name"}, where)
            self.assertIsInstance(frame["line"], int, where)

    def test_fields_are_where_the_viewer_reads_them(self) -> None:
        for rank in RANKS:
            data = self.snapshot(f"snapshot_rank{rank}.pickle")
            self.assertLessEqual({"segments", "device_traces"}, set(data))
            for segment in data["segments"]:
                self.assertLessEqual(SEGMENT_FIELDS, set(segment))
                self.assertEqual(segment["total_size"],
                                 sum(b["size"] for b in segment["blocks"]))
                offset = segment["address"]
                for block in segment["blocks"]:
                    self.assertLessEqual(BLOCK_FIELDS, set(block))
                    self.assertEqual(block["address"], offset)  # blocks tile the segment
                    offset += block["size"]
                    self.check_frames(block["frames"], "block")
                    if block["state"] == "active_allocated":
                        self.assertTrue(block["frames"])
                        self.assertLessEqual(block["requested_size"], block["size"])
            trace = data["device_traces"][0]
            segment_actions = [e for e in trace if e["action"].startswith("segment")]
            self.assertTrue(segment_actions)
            for entry in trace:
                self.assertEqual(set(entry), TRACE_FIELDS)
                self.assertIn(entry["action"], ACTIONS)
                self.check_frames(entry["frames"], entry["action"])
            for entry in segment_actions:  # which allocation made the allocator map it
                self.assertTrue(entry["frames"], entry)

    def test_trace_covers_the_whole_last_iteration(self) -> None:
        for rank in RANKS:
            data = self.snapshot(f"snapshot_rank{rank}.pickle")
            last = self.summary(rank)["iterations"][-1]
            trace = data["device_traces"][0]
            # Memory in use over the trace, as the viewer rebuilds it: backwards from the
            # blocks allocated when the snapshot was taken (requested sizes, as the trace's).
            live = sum(b["requested_size"] for s in data["segments"] for b in s["blocks"]
                       if b["state"] == "active_allocated")
            levels = [live]
            for entry in reversed(trace):
                if entry["action"] == "alloc":
                    live -= entry["size"]
                elif entry["action"] == "free_completed":
                    live += entry["size"]
                levels.append(live)
            # The trace starts where the iteration starts (its static memory: requested
            # sizes are at most the blocks' rounded ones), reaches its peak, and ends after
            # the optimizer step, back at the start's level.
            start_mib, peak_mib = levels[-1] / 2**20, max(levels) / 2**20
            self.assertLessEqual(start_mib, last["static_memory_MB"])
            self.assertGreater(start_mib, 0.999 * last["static_memory_MB"])
            self.assertLessEqual(peak_mib, last["peak_allocated_MB"])
            self.assertGreater(peak_mib, 0.999 * last["peak_allocated_MB"])
            self.assertEqual(levels[0], levels[-1])
            # From the iteration's first event to its last, as the memory trace's samples
            # (whose first one is the iteration's start: on the pipeline clock a later
            # stage waits there for its first input before its first event).
            samples = json.loads((self.out / f"memory_trace_rank{rank}.json").read_text())
            times_s = [x["timestamp_s"] for x in samples[str(last["iteration"])]["samples"]]
            self.assertLessEqual(times_s[0], trace[0]["time_us"] / 1e6 + 1e-6)
            self.assertAlmostEqual(trace[0]["time_us"] / 1e6, times_s[1], delta=2e-6)
            self.assertAlmostEqual(trace[-1]["time_us"] / 1e6, max(times_s), delta=2e-6)


if __name__ == "__main__":
    unittest.main()
