"""tools/gpu/megatron_fake_pg.py without a GPU: the launch line it gives Megatron-LM for a
validation case, the compact allocator history it keeps, and the stand-in modules it makes
for imports Megatron cannot do without."""

from __future__ import annotations

import importlib
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
