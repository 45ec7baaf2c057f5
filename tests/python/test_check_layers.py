"""tools/check_layers.py: the repository keeps its layering, and an include against an
arrow (here simulator/ including models/) is refused with the file, line and rule."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "check_layers.py"


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)],
                          capture_output=True, text=True, check=False)


class CheckLayersTest(unittest.TestCase):
    def test_repository_keeps_its_layers(self):
        result = check(REPO)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stderr, "")

    def test_wrong_direction_include_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for folder in ("simulator", "models", "parallel/regions"):
                (root / folder).mkdir(parents=True)
            (root / "models" / "layers.h").write_text("#pragma once\n")
            (root / "parallel" / "regions" / "tp.h").write_text("#pragma once\n")
            # Allowed: models/ above parallel/regions/ above simulator/.
            (root / "models" / "layers.cc").write_text(
                '#include "models/layers.h"\n#include "parallel/regions/tp.h"\n'
                '#include "simulator/recorder.h"\n#include <vector>\n')
            # A unit's test beside it may use any layer: it is not part of the library.
            (root / "simulator" / "recorder_test.cc").write_text('#include "models/layers.h"\n')
            self.assertEqual(check(root).returncode, 0)
            (root / "simulator" / "recorder.cc").write_text(
                '#include <vector>\n\n#include "models/layers.h"\n')
            result = check(root)
            self.assertEqual(result.returncode, 1)
            self.assertEqual(result.stderr.splitlines(), [
                "check_layers: simulator/recorder.cc:3: includes models/layers.h, but simulator/ "
                "may include only itself and the layers below it (nothing else); move the code "
                "to the lower layer or pass what it needs down"])


if __name__ == "__main__":
    unittest.main()
