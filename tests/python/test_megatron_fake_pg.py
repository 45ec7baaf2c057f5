"""tools/gpu/megatron_fake_pg.py without a GPU: the launch line it gives Megatron-LM for a
validation case, the compact allocator history it keeps, the run in Megatron's
memory-tracer schema, and the stand-in modules it makes for imports Megatron cannot do
without."""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))
import megatron_fake_pg as fake_pg  # noqa: E402


def value_after(argv: list, flag: str) -> str:
    return argv[argv.index(flag) + 1]


class LaunchLineTest(unittest.TestCase):
    CASE = {"args": {
        "--num-layers": 12, "--bf16": True, "--no-such-flag": False,
        "--save": "${CHECKPOINT_SAVE_PATH}", "--load": "${CHECKPOINT_LOAD_PATH}",
        "--data-path": "x", "--vocab-file": "v.json", "--merge-file": "m.txt",
        "--train-iters": 50, "--eval-iters": 10, "--tensorboard-dir": "${TENSORBOARD_PATH}",
        "--recompute-modules": ["core_attn", "mlp"],
    }}

    def test_files_and_schedules_are_replaced(self):
        argv = fake_pg.launch_line(self.CASE, 5, "/tmp/tb")
        for dropped in ("--save", "--load", "--data-path", "--vocab-file", "--merge-file"):
            self.assertNotIn(dropped, argv)
        self.assertNotIn("--no-such-flag", argv)  # false flags are left out
        self.assertEqual(argv.count("--train-iters"), 1)
        self.assertEqual(value_after(argv, "--train-iters"), "5")
        self.assertEqual(value_after(argv, "--eval-iters"), "0")
        self.assertEqual(value_after(argv, "--tensorboard-dir"), "/tmp/tb")
        self.assertEqual(argv[argv.index("--recompute-modules") + 1:][:2], ["core_attn", "mlp"])
        for flag in ("--bf16", "--mock-data", "--fake-process-group", "--no-persist-layer-norm",
                     "--no-rope-fusion"):
            self.assertIn(flag, argv)

    def test_vocabulary_is_gpt2s_unless_the_case_names_one(self):
        argv = fake_pg.launch_line(self.CASE, 5, "/tmp/tb")
        self.assertEqual(value_after(argv, "--tokenizer-type"), "NullTokenizer")
        self.assertEqual(value_after(argv, "--vocab-size"), "50257")
        own = {"args": dict(self.CASE["args"], **{"--vocab-size": 131073})}
        argv = fake_pg.launch_line(own, 5, "/tmp/tb")
        self.assertEqual(argv.count("--vocab-size"), 1)
        self.assertEqual(value_after(argv, "--vocab-size"), "131073")


class CaseSpecTest(unittest.TestCase):
    def test_iterations_after_the_last_colon(self):
        self.assertEqual(fake_pg.case_and_iterations("cases/a.yaml:30", 8), ("cases/a.yaml", 30))
        self.assertEqual(fake_pg.case_and_iterations("cases/a.yaml", 8), ("cases/a.yaml", 8))
        # A colon inside the path, or a suffix that is no positive count, is part of the path.
        self.assertEqual(fake_pg.case_and_iterations("c:d/a.yaml", 8), ("c:d/a.yaml", 8))
        self.assertEqual(fake_pg.case_and_iterations("c:d/a.yaml:5", 8), ("c:d/a.yaml", 5))
        self.assertEqual(fake_pg.case_and_iterations("a.yaml:0", 8), ("a.yaml:0", 8))
        self.assertEqual(fake_pg.case_and_iterations("a.yaml:x", 8), ("a.yaml:x", 8))


class CompactTraceTest(unittest.TestCase):
    def test_frames_are_shared_and_other_actions_dropped(self):
        megatron = {"filename": "/x/mlm/megatron/core/layers.py", "line": 7, "name": "forward"}
        torch_frame = {"filename": "/venv/site-packages/torch/nn/module.py", "line": 3,
                       "name": "_call_impl"}
        elsewhere = {"filename": "/usr/lib/python3.12/threading.py", "line": 1, "name": "run"}
        snapshot = {"device_traces": [[
            {"action": "alloc", "size": 512, "addr": 16, "frames": [megatron, elsewhere]},
            {"action": "free_requested", "size": 512, "addr": 16, "frames": []},
            {"action": "free_completed", "size": 512, "addr": 16, "frames": [megatron]},
            {"action": "segment_alloc", "size": 2 << 20, "addr": 0,
             "frames": [torch_frame, megatron]},
            {"action": "snapshot", "size": 0, "addr": 0, "frames": []},
        ]]}
        trace = fake_pg.compact_trace(snapshot)
        self.assertEqual(trace["frames"], [["megatron/core/layers.py:7:forward"],
                                           ["torch/nn/module.py:3:_call_impl",
                                            "megatron/core/layers.py:7:forward"]])
        self.assertEqual(trace["events"], [["alloc", 512, 16, 0], ["free_completed", 512, 16, 0],
                                           ["segment_alloc", 2 << 20, 0, 1]])


class IterationTraceTest(unittest.TestCase):
    MIB = 1 << 20
    EVENTS = [
        {"action": "segment_alloc", "size": 2 * MIB, "time_us": 5},
        {"action": "alloc", "size": MIB, "time_us": 10},
        {"action": "alloc", "size": MIB, "time_us": 20},
        {"action": "free_completed", "size": MIB, "time_us": 30},
        {"action": "alloc", "size": 512, "time_us": 110},
        {"action": "segment_alloc", "size": 2 * MIB, "time_us": 115},
        {"action": "free_completed", "size": MIB, "time_us": 120},
    ]
    STEPS = [{"start_us": 0, "end_us": 50}, {"start_us": 100, "end_us": 130}]

    def samples(self, iteration):
        return [(round(x["timestamp_s"] * 1e6), x["allocated_memory_MB"], x["reserved_memory_MB"])
                for x in iteration["samples"]]

    def test_each_step_is_an_iteration_with_its_extremes(self):
        # Two bins a step: step 0 keeps [0, 25)'s lowest (t 5) and highest (t 20) and
        # [25, 50)'s one sample; step 1 starts with the state before it (1 MiB, 2 MiB
        # reserved), keeps the reserved change at 115 and its bins' extremes.
        trace = fake_pg.iteration_trace({"device_traces": [self.EVENTS]}, self.STEPS, 100, bins=2)
        self.assertEqual(list(trace), ["0", "1"])
        self.assertEqual(self.samples(trace["0"]), [(5, 0.0, 2.0), (20, 2.0, 2.0), (30, 1.0, 2.0)])
        self.assertEqual(trace["0"]["peak_allocated_MB"], 2.0)
        self.assertEqual(self.samples(trace["1"]), [(0, 1.0, 2.0), (10, 1 + 1 / 2048, 2.0),
                                                    (15, 1 + 1 / 2048, 4.0), (20, 1 / 2048, 4.0)])
        with tempfile.TemporaryDirectory() as folder:  # the reader memsim compare uses
            path = Path(folder) / "memory_trace_rank7_case.json"
            path.write_text(json.dumps(trace))
            sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "plots"))
            from traces import load_trace
            self.assertEqual([i.peak_allocated_mb for i in load_trace(path)], [2.0, 1 + 1 / 2048])

    def test_a_full_history_or_an_empty_step_is_refused(self):
        with self.assertRaisesRegex(ValueError, "filled its 7 entries"):
            fake_pg.iteration_trace({"device_traces": [self.EVENTS]}, self.STEPS, 7)
        with self.assertRaisesRegex(ValueError, "no allocator event inside train_step 0"):
            fake_pg.iteration_trace({"device_traces": [self.EVENTS]},
                                    [{"start_us": 60, "end_us": 70}], 100)


class StubTest(unittest.TestCase):
    def test_a_stub_answers_any_attribute_call_and_subclass(self):
        with tempfile.TemporaryDirectory() as folder:
            fake_pg.make_stub(folder, "absent_package.sub.module")
            sys.path.insert(0, folder)
            try:
                module = importlib.import_module("absent_package.sub.module")
                Thing = module.Thing
                self.assertIsNotNone(Thing.create({}).to_yaml())

                class Derived(Thing):
                    pass

                self.assertIsInstance(Derived(1, key=2), Thing)
                with self.assertRaises(AttributeError):
                    module.__wrapped__  # dunder names stay absent, as hasattr expects
            finally:
                sys.path.remove(folder)
                for name in [n for n in sys.modules if n.startswith("absent_package")]:
                    del sys.modules[name]


if __name__ == "__main__":
    unittest.main()
