"""memsim view: the HTML page of a simulate, sweep or plan folder, loaded in a real browser
(Debian's headless Chromium, from file://): no console errors, the numbers it renders are
the summary's, a screenshot has content; and the page needs nothing from the network."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import unittest
from html.parser import HTMLParser
from pathlib import Path

from .helpers import BINARY, CliTestCase, run_cli, simulate_gpt3_tp2_pp2, write_json


def chromium() -> str:
    """Debian's chromium is a test dependency (tools/dev.sh installs it): its absence is a
    failure, not a skip."""
    path = shutil.which("chromium")
    if path is None:
        raise AssertionError("chromium is not installed; install Debian's chromium "
                             "(tools/dev.sh does)")
    return path


def browse(page: Path, *options: str, fragment: str = "") -> subprocess.CompletedProcess:
    """Loads `page` (with `#fragment` when given) in headless Chromium with console
    messages logged to stderr."""
    profile = tempfile.mkdtemp(prefix="memsim_chromium_")
    try:
        return subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
             "--v=0", f"--user-data-dir={profile}", *options,
             page.resolve().as_uri() + (f"#{fragment}" if fragment else "")],
            capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def console_messages(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


class Rendered(HTMLParser):
    """What the rendered DOM shows: the text of elements with data-* markers, by rank."""

    def __init__(self) -> None:
        super().__init__()
        self.rank: str | None = None
        self.fields: dict[tuple[str, str], str] = {}  # (rank, data-field) -> text
        self.categories: dict[tuple[str, str], str] = {}
        self.modules: dict[tuple[str, str], str] = {}
        self.rows: dict[tuple[str | None, str], int] = {}  # (rank, data-table) -> body rows
        self.headings: dict[tuple[str | None, str], str] = {}  # (rank, "h2") -> its title
        self.heatmap_cells = 0
        self.body_rendered = False
        self._capture: tuple[dict, tuple[str, str]] | None = None
        self._table: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body_rendered = a.get("data-rendered") == "true"
        if tag == "section" and "data-rank" in a:
            self.rank = a["data-rank"]
        if tag == "table" and "data-table" in a:
            self._table = a["data-table"]
        if tag == "tr" and self._table in ("tensors", "layouts"):
            key = (self.rank, self._table)
            self.rows[key] = self.rows.get(key, 0) + 1
        if tag == "td" and self._table == "heatmap":
            self.heatmap_cells += 1
        if tag == "h2" and self.rank is not None:
            self._capture = (self.headings, (self.rank, "h2"))
        for attr, store in (("data-field", self.fields), ("data-category", self.categories),
                            ("data-module", self.modules)):
            if attr in a:
                self._capture = (store, (self.rank, a[attr]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._capture:
            store, key = self._capture
            store[key] = store.get(key, "") + data
            self._capture = None


def mib(text: str) -> float:
    """ "7,358.8 MiB" -> 7358.8 """
    match = re.fullmatch(r"([\d,]+\.\d) MiB", text.strip())
    if not match:
        raise AssertionError(f"not a MiB value: {text!r}")
    return float(match[1].replace(",", ""))


class ViewTest(CliTestCase):
    """One simulate run (GPT-3 1.3B, 8 GPUs, TP2 PP2) viewed in Chromium."""

    run_dir: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls.root = Path(tempfile.mkdtemp(prefix="memsim_view_test_"))
        cls.run_dir = cls.root / "run"
        simulate_gpt3_tp2_pp2(cls.run_dir)
        cls.page = cls.root / "report.html"
        view = run_cli("view", cls.run_dir, "-o", cls.page)
        if view.returncode != 0:
            raise AssertionError(f"memsim view failed: {view.stderr}")

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.root, ignore_errors=True)

    def summary(self, rank: int) -> dict:
        return json.loads((self.run_dir / f"summary_rank{rank}.json").read_text())

    def test_page_needs_no_network(self) -> None:
        text = self.page.read_text()
        self.assertIsNone(re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", text))
        self.assertNotIn("https://", text.split('<script id="memsim-data"')[0])
        self.assertEqual(text.count("<script"), 2)  # the data and the inlined script

    def test_rendered_numbers_are_the_summarys(self) -> None:
        result = browse(self.page, "--dump-dom")
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertEqual(console_messages(result), [])  # no errors, no warnings, no logs
        dom = Rendered()
        dom.feed(result.stdout)
        self.assertTrue(dom.body_rendered, "the script did not finish")
        for rank in (0, 4):
            summary, r = self.summary(rank), str(rank)
            for field in ("peak_allocated_MB", "peak_reserved_MB", "static_memory_MB",
                          "headroom_MB"):
                self.assertAlmostEqual(mib(dom.fields[(r, field)]), summary[field], delta=0.05,
                                       msg=field)
            self.assertEqual(dom.fields[(r, "peak_phase")], summary["peak_phase"])
            # Each stage's class stands for 4 ranks (TP 2 x DP 2), from the summary's spans.
            self.assertEqual(dom.headings[(r, "h2")],
                             f"Rank {rank} (class of 4 ranks), pipeline stage {rank // 4}")
            for category, mb in summary["breakdown_at_peak_MB"].items():
                if mb > 0:
                    self.assertAlmostEqual(mib(dom.categories[(r, category)]), mb, delta=0.05)
            # Layers merged into groups lose nothing: the groups add up to the modules.
            shown = sum(mib(text) for (at, _), text in dom.modules.items() if at == r)
            modules = summary["modules_at_peak"]
            self.assertAlmostEqual(shown, sum(m["MB"] for m in modules), delta=0.05 * len(modules))
            self.assertIn("decoder.layers.*.mlp", {m for at, m in dom.modules if at == r})
            self.assertEqual(dom.rows[(r, "tensors")],
                             len(summary["largest_tensors_at_peak"]) + 1)  # + the header

    def test_timeline_zooms_to_the_window_in_the_address(self) -> None:
        whole = Rendered()
        whole.feed(browse(self.page, "--dump-dom").stdout)
        result = browse(self.page, "--dump-dom", fragment="zoom=0.01,0.02")
        self.assertEqual(console_messages(result), [])
        zoomed = Rendered()
        zoomed.feed(result.stdout)
        for rank in ("0", "4"):
            self.assertRegex(whole.fields[(rank, "timeline-window")],
                             r"^virtual time in iteration 1 \(s\): 0\.00 to [0-9.]+$")
            self.assertEqual(zoomed.fields[(rank, "timeline-window")],
                             "virtual time in iteration 1 (s): 0.0100 to 0.0200 "
                             "(zoomed; double-click for all)")
        # A window that is not one (from >= to) shows the whole iteration.
        wrong = Rendered()
        wrong.feed(browse(self.page, "--dump-dom", fragment="zoom=0.02,0.01").stdout)
        self.assertEqual(wrong.fields[("0", "timeline-window")],
                         whole.fields[("0", "timeline-window")])

    def test_screenshot_has_content(self) -> None:
        shot = self.root / "shot.png"
        result = browse(self.page, f"--screenshot={shot}", "--window-size=1200,1600")
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        image = self.assert_png(shot, 1200, 1600)
        # The timeline's blue line is drawn: some pixels are the allocated colour #1f77b4.
        rgb = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
        self.assertGreater(((abs(rgb - [0x1F, 0x77, 0xB4]).sum(axis=1)) < 30).sum(), 100)


class ViewSweepAndPlanTest(CliTestCase):
    """A sweep's and a plan's folder: their layouts, sortable, and the sweep's heatmap."""

    def test_sweep_page(self) -> None:
        out = self.tmp / "sweep"
        result = subprocess.run(
            [str(BINARY), "sweep", "--model", "gpt3-1.3b", "--world-size", "8",
             "--global-batch-size", "16", "--tp", "1,2,3", "--pp", "1,2", "--out", str(out)],
            capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.run_ok("view", out)
        page = out / "report.html"
        browsed = browse(page, "--dump-dom")
        self.assertEqual(console_messages(browsed), [])
        dom = Rendered()
        dom.feed(browsed.stdout)
        records = json.loads((out / "sweep_results.json").read_text())
        self.assertEqual(dom.rows[(None, "layouts")], len(records) + 1)
        self.assertEqual(dom.heatmap_cells, 3 * 2)  # TP 1, 2, 3 x PP 1, 2
        self.assertIn("invalid", browsed.stdout)  # TP=3 does not divide the heads

    def test_plan_page(self) -> None:
        layout = {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "dp": 4, "micro_batch_size": 1,
                  "recompute": "none", "data_parallel": "ddp", "verdict": "fits", "step_s": 0.1,
                  "tokens_per_s_per_gpu": 1000.0, "headroom_GiB": 5.0}
        write_json(self.tmp / "plan" / "plan.json", {
            "run": "gpt3-1.3b on 8 x H100-80GB", "world_size": 8, "usable_GiB": 79.1,
            "layouts": [layout, {**layout, "tp": 4, "dp": 2, "step_s": 0.2}]})
        self.run_ok("view", self.tmp / "plan", "-o", self.tmp / "plan.html")
        browsed = browse(self.tmp / "plan.html", "--dump-dom")
        self.assertEqual(console_messages(browsed), [])
        dom = Rendered()
        dom.feed(browsed.stdout)
        self.assertEqual(dom.rows[(None, "layouts")], 3)
        self.assertEqual(dom.heatmap_cells, 2)  # TP 2 and 4 x PP 1: each layout's step
        self.assertIn("0.10 s", browsed.stdout)
        self.assertIn("0.20 s", browsed.stdout)

    def test_corrupt_snapshot_is_one_line_naming_it(self) -> None:
        run_dir = self.tmp / "run"
        write_json(run_dir / "summary_rank0.json", {
            "rank": 0, "peak_allocated_MB": 10.0, "phases": {"forward": {"peak_allocated_MB": 10.0}},
            "enum_names": {"phase": ["setup", "forward", "backward", "optimizer"]},
            "modules_at_peak": [], "largest_tensors_at_peak": []})
        snapshot = run_dir / "snapshot_rank0.pickle"
        snapshot.write_bytes(b"\x80\x02}q\x00(X")  # cut off in its first string
        self.assert_bad_input(run_cli("view", run_dir), "view", snapshot,
                              "not a readable snapshot pickle")
        self.assertFalse((run_dir / "report.html").exists())

    def test_folder_without_memsim_output(self) -> None:
        (self.tmp / "empty").mkdir()
        self.assert_bad_input(run_cli("view", self.tmp / "empty"), "view", self.tmp / "empty",
                              "summary_rank{R}.json")
        self.assertEqual(list((self.tmp / "empty").iterdir()), [])


if __name__ == "__main__":
    unittest.main()
