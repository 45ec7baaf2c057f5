#!/usr/bin/python3
"""Runs memsim's benchmarks in one go, prints a table of medians and writes BENCHMARKS.md.

Run from the repository root after building (this script builds nothing):
    cmake --build build -j1 --target memsim memsim_bench
    /usr/bin/python3 benchmarks/run_benchmarks.py [--quick] [--output BENCHMARKS.md]

Measures: one GPT layer forward+backward (build/memsim_bench, with and without op
attribution) against the PyTorch TorchDispatchMode tracer (benchmarks/python_tracer.py);
the Llama-3-70B per-layout command and the process start alone; whole layouts simulated
in-process (build/memsim_bench); the 24-layout GPT-485B sweep; scaling with
microbatches and with world size. Wall time is measured around each child process and
peak RSS comes from that child's rusage (os.wait4, ru_maxrss). The exit status is nonzero
only when something failed to run; a missed bar is reported as MISS, not as a failure.
"""
import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMSIM = os.path.join("build", "memsim")
MEMSIM_BENCH = os.path.join("build", "memsim_bench")
TRACER = os.path.join("benchmarks", "python_tracer.py")

# The bars.
BAR_LAYER_MS = 0.15
BAR_SPEEDUP = 10.0
BAR_SWEEP_S = 30.0
BAR_RSS_MB = 1000.0  # 1 GB; MB = 10^6 bytes
# Speed for search (issue 17), measured in-process by memsim_bench.
BAR_LAYOUT_MS = 300.0
# The same layout as a command (process start and its files included), as the issue's
# table measured it (3.0-3.4 s, 725 MB then).
BAR_LAYOUT_COMMAND_S = 0.3
BAR_LAYOUT_RSS_MB = 300.0
BAR_MICROBATCH_RATIO = 1.2
BAR_LAYER_RATIO = 1.5
BAR_LAYOUT_SPEEDUP = 100.0
TRACER_LAYOUT_MICROBATCHES = [8, 128]

LAYOUT_ARGS = ["simulate", "--model", "llama3-70b", "--world-size", "128", "--tp", "8",
               "--pp", "4", "--sp", "--data-parallel", "distributed-optimizer",
               "--seq-length", "8192", "--global-batch-size", "512", "--micro-batch-size", "1",
               "--recompute", "selective", "--iterations", "2"]
SWEEP_ARGS = ["sweep", "--model", "gpt-485b", "--world-size", "8192", "--precision", "fp16",
              "--seq-length", "2048", "--tp", "1,2,4,8", "--pp", "2,4,8,16,32,64",
              "--microbatches-per-pp", "6", "--data-parallel", "distributed-optimizer",
              "--jobs", "2"]
SCALING_MICROBATCHES = [8, 64, 128, 512]
SCALING_WORLD_SIZES = [128, 1024, 8192, 16384]
SCALING_FIXED_MICROBATCHES = 8


class RunError(Exception):
    pass


def replace_arg(args, name, value):
    """Returns args with option `name`'s value replaced (or the option dropped if value is None)."""
    out = list(args)
    i = out.index(name)
    if value is None:
        del out[i:i + 2]
    else:
        out[i + 1] = str(value)
    return out


def run_child(argv, workdir):
    """Runs argv; returns (wall seconds, peak RSS in MB, stdout). Raises RunError on failure."""
    stdout_path = os.path.join(workdir, "stdout.txt")
    stderr_path = os.path.join(workdir, "stderr.txt")
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") \
        else (status >> 8)
    with open(stdout_path, "r", errors="replace") as f:
        stdout = f.read()
    if proc.returncode != 0:
        with open(stderr_path, "r", errors="replace") as f:
            tail = (f.read().strip().splitlines() or ["(no stderr)"])[-1]
        raise RunError("%s exited with %d: %s" % (" ".join(argv[:2]), proc.returncode, tail))
    return wall, usage.ru_maxrss * 1024 / 1e6, stdout  # ru_maxrss is KiB on Linux


def run_memsim(args, runs):
    """Runs `build/memsim args --out <tmp>` `runs` times; returns lists of walls and RSS."""
    walls, rss = [], []
    for _ in range(runs):
        tmp = tempfile.mkdtemp(prefix="memsim_bench_")
        try:
            wall, peak, _ = run_child([MEMSIM] + list(args) + ["--out", os.path.join(tmp, "out")], tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        walls.append(wall)
        rss.append(peak)
    return walls, rss


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def python_for_tracer():
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    raise RunError("no Python with torch found for the tracer (run with /usr/bin/python3)")


def sh(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, cwd=REPO).stdout.strip()
    except OSError:
        return ""


def binary_mtimes():
    return {path: os.path.getmtime(os.path.join(REPO, path)) for path in (MEMSIM, MEMSIM_BENCH)}


def machine_info():
    info = {"nproc": sh(["nproc"]) or str(os.cpu_count())}
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["cpu"] = cpu or platform.processor() or "unknown"
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = "%.1f GiB" % (int(line.split()[1]) / 1024 / 1024)
                    break
    except OSError:
        pass
    info["memory"] = mem or "unknown"
    os_name = ""
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    info["os"] = "%s (Linux %s)" % (os_name or platform.system(), platform.release())
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = sh(["git", "rev-parse", "--short=12", "HEAD"]) or "unknown"
    if sh(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (with uncommitted changes)"
    info["commit"] = commit
    built = []
    for path in (MEMSIM, MEMSIM_BENCH):
        mtime = os.path.getmtime(os.path.join(REPO, path))
        built.append("%s %s" % (path, datetime.datetime.fromtimestamp(
            mtime, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")))
    info["binaries"] = ", ".join(built)
    return info


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


# ----------------------------------------------------------------------------- measurements

def bench_medians(benchmark_filter, tmp):
    """Runs build/memsim_bench on the cases `benchmark_filter` selects; returns their median
    aggregates, each with its real time in ms as "median_ms"."""
    _, _, out = run_child([MEMSIM_BENCH, "--benchmark_format=json",
                           "--benchmark_filter=" + benchmark_filter], tmp)
    try:
        data = json.loads(out)
    except ValueError:
        raise RunError("memsim_bench printed no JSON")
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
    medians = [b for b in data.get("benchmarks", []) if b.get("aggregate_name") == "median"]
    for b in medians:
        b["median_ms"] = b["real_time"] * scale[b.get("time_unit", "ns")]
    return medians


def measure_layer(quick, tmp):
    log("[1/6] per layer: build/memsim_bench (BM_GptLayer, 5 repetitions x >= 1 s each)")
    layer = {}
    for b in bench_medians("BM_GptLayer", tmp):
        key = "attribution" if "attribution:1" in b["run_name"] else "no_attribution"
        layer[key] = {"median_ms": b["median_ms"],
                      "events_per_layer": b.get("events_per_layer"),
                      "repetitions": b.get("repetitions"), "iterations": b.get("iterations")}
    if set(layer) != {"attribution", "no_attribution"}:
        raise RunError("memsim_bench JSON lacks BM_GptLayer/attribution:1 or :0 medians")
    return layer


def measure_tracer(quick, tmp):
    """The Python tracer on the same layer (needs torch in that Python)."""
    iterations = 50 if quick else 1000
    log("[2/6] per layer: Python TorchDispatchMode tracer (%d iterations)" % iterations)
    _, _, out = run_child([python_for_tracer(), TRACER, "--iterations", str(iterations)], tmp)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RunError("python_tracer.py printed no JSON")


def measure_tracer_layout(quick, tmp):
    """The Python tracer running the whole Llama-3-70B layout (every stage, layer and
    microbatch), for the microbatch counts memsim_bench's BM_Llama70bLayout also runs."""
    runs = {}
    for mbs in TRACER_LAYOUT_MICROBATCHES[:1] if quick else TRACER_LAYOUT_MICROBATCHES:
        log("[2/6] whole layout: Python TorchDispatchMode tracer, %d microbatches" % mbs)
        _, _, out = run_child([python_for_tracer(), TRACER, "--layout", "llama70b",
                               "--microbatches", str(mbs)], tmp)
        try:
            runs[mbs] = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise RunError("python_tracer.py --layout printed no JSON")
    return runs


def measure_layout(quick):
    runs = 1 if quick else 5
    log("[3/6] per layout: Llama-3-70B, %d run(s), and the process start alone" % runs)
    walls, rss = run_memsim(LAYOUT_ARGS, runs)
    start_walls, _ = run_memsim(["--version"], runs)
    return {"runs": runs, "walls": walls, "median_s": statistics.median(walls),
            "peak_rss_mb": max(rss), "start_median_s": statistics.median(start_walls)}


def measure_in_process(tmp):
    """Medians of memsim_bench's whole-layout cases: one process, no files, no start-up."""
    log("[4/6] per layout in-process: build/memsim_bench (BM_Llama70bLayout, BM_Gpt485bLayers)")
    cases = {}
    for b in bench_medians("BM_Llama70bLayout|BM_Gpt485bLayers", tmp):
        name = b["run_name"].replace("/iterations:1", "").replace("/repeats:3", "")
        cases[name] = {"median_ms": b["median_ms"], "events": b.get("events")}
    if not cases:
        raise RunError("memsim_bench JSON lacks the layout medians")
    return cases


def measure_sweep(quick):
    log("[5/6] sweep: GPT-485B, 24 layouts, --jobs 2")
    walls, rss = run_memsim(SWEEP_ARGS, 1)
    if not quick and walls[0] < 60:
        more_walls, more_rss = run_memsim(SWEEP_ARGS, 2)
        walls += more_walls
        rss += more_rss
    return {"runs": len(walls), "walls": walls, "median_s": statistics.median(walls),
            "peak_rss_mb": max(rss)}


def measure_scaling(quick):
    log("[6/6] scaling: microbatches %s, world sizes %s (1 run each)"
        % (SCALING_MICROBATCHES, SCALING_WORLD_SIZES))
    base = replace_arg(LAYOUT_ARGS, "--global-batch-size", None)
    rows = []
    for mb in SCALING_MICROBATCHES:
        walls, rss = run_memsim(base + ["--num-microbatches", str(mb)], 1)
        rows.append({"kind": "microbatches", "world_size": 128, "microbatches": mb,
                     "wall_s": walls[0], "peak_rss_mb": rss[0]})
    for ws in SCALING_WORLD_SIZES:
        args = replace_arg(base, "--world-size", ws) + [
            "--num-microbatches", str(SCALING_FIXED_MICROBATCHES)]
        walls, rss = run_memsim(args, 1)
        rows.append({"kind": "world_size", "world_size": ws,
                     "microbatches": SCALING_FIXED_MICROBATCHES,
                     "wall_s": walls[0], "peak_rss_mb": rss[0]})
    return rows


# ----------------------------------------------------------------------------- reporting

def mb(value):
    """Formats MB (10^6 bytes) with MiB beside it, since '1 GB' is read both ways."""
    return "%.0f MB (%.0f MiB)" % (value, value * 1e6 / 2**20)


def verdict(ok):
    return "PASS" if ok else "MISS"


def build_rows(results):
    """Returns (table rows [(measurement, value, bar, status)], bar rows) from what ran."""
    rows, bars = [], []
    layer = results.get("layer")
    if layer:
        att = layer["attribution"]["median_ms"]
        noatt = layer["no_attribution"]["median_ms"]
        rows.append(("per layer, memsim, attribution on (median of %d reps)"
                     % layer["attribution"]["repetitions"], "%.3f ms" % att,
                     "<= %.2f ms" % BAR_LAYER_MS, verdict(att <= BAR_LAYER_MS)))
        rows.append(("per layer, memsim, attribution off (median of %d reps)"
                     % layer["no_attribution"]["repetitions"], "%.3f ms" % noatt, "", ""))
        bars.append(("per layer <= %.2f ms with attribution" % BAR_LAYER_MS, "%.3f ms" % att,
                     verdict(att <= BAR_LAYER_MS)))
    tracer = results.get("tracer")
    if layer and tracer:
        att = layer["attribution"]["median_ms"]
        noatt = layer["no_attribution"]["median_ms"]
        py = tracer["median_ms"]
        rows.append(("per layer, Python TorchDispatchMode tracer (median of %d iters, %s attn)"
                     % (tracer["iterations"], tracer["attention"]), "%.3f ms" % py, "", ""))
        rows.append(("speed-up python / memsim (attribution on)", "%.1fx" % (py / att),
                     ">= %.0fx" % BAR_SPEEDUP, verdict(py / att >= BAR_SPEEDUP)))
        rows.append(("speed-up python / memsim (attribution off)", "%.1fx" % (py / noatt),
                     "", ""))
        bars.append((">= %.0fx faster than the Python tracer" % BAR_SPEEDUP, "%.1fx" % (py / att),
                     verdict(py / att >= BAR_SPEEDUP)))
    layout = results.get("layout")
    if layout:
        how = "median of %d runs" % layout["runs"] if layout["runs"] > 1 else "1 run"
        rows.append(("per layout, Llama-3-70B 128 GPUs (%s)" % how,
                     "%.2f s" % layout["median_s"], "", ""))
        rows.append(("per layout, peak RSS (max over runs)", mb(layout["peak_rss_mb"]),
                     "< %.0f MB" % BAR_RSS_MB, verdict(layout["peak_rss_mb"] < BAR_RSS_MB)))
    if layout:
        rows.append(("process start alone, `memsim --version` (%s)" % how,
                     "%.2f s" % layout["start_median_s"], "", ""))
    cases = results.get("in_process") or {}
    for name, case in sorted(cases.items()):
        rows.append(("in-process %s (median of 3)" % name,
                     "%.0f ms, %.0f events" % (case["median_ms"], case["events"] or 0), "", ""))
    tracer_layout = results.get("tracer_layout") or {}
    for mbs, run in sorted(tracer_layout.items()):
        rows.append(("whole layout, Python tracer, Llama-3-70B, %d microbatches (1 run, %d layer "
                     "passes)" % (mbs, run["layer_passes"]), "%.2f s" % run["seconds"], "", ""))
        own = cases.get("BM_Llama70bLayout/microbatches:%d/jobs:1" % mbs)
        if own:
            speedup = run["seconds"] * 1e3 / own["median_ms"]
            rows.append(("speed-up python / memsim, whole layout, %d microbatches, 1 thread" % mbs,
                         "%.0fx" % speedup, ">= %.0fx" % BAR_LAYOUT_SPEEDUP,
                         verdict(speedup >= BAR_LAYOUT_SPEEDUP)))
            if mbs == max(tracer_layout):
                bars.append((">= %.0fx faster than the Python tracer on the whole layout (%d "
                             "microbatches, 1 thread)" % (BAR_LAYOUT_SPEEDUP, mbs),
                             "%.0fx" % speedup, verdict(speedup >= BAR_LAYOUT_SPEEDUP)))
    llama = {mbs: cases.get("BM_Llama70bLayout/microbatches:%d/jobs:2" % mbs) for mbs in (128, 512)}
    if llama[128]:
        ms = llama[128]["median_ms"]
        bars.append(("Llama-3-70B layout in-process <= %.0f ms (128 microbatches, 2 jobs)"
                     % BAR_LAYOUT_MS, "%.0f ms" % ms, verdict(ms <= BAR_LAYOUT_MS)))
    if llama[128] and llama[512]:
        ratio = llama[512]["median_ms"] / llama[128]["median_ms"]
        bars.append(("512 / 128 microbatches <= %.1fx" % BAR_MICROBATCH_RATIO, "%.2fx" % ratio,
                     verdict(ratio <= BAR_MICROBATCH_RATIO)))
    gpt = [cases.get("BM_Gpt485bLayers/layers:%d" % n) for n in (24, 96)]
    if all(gpt):
        ratio = gpt[1]["median_ms"] / gpt[0]["median_ms"]
        bars.append(("485B GPT, 96 / 24 layers <= %.1fx" % BAR_LAYER_RATIO, "%.2fx" % ratio,
                     verdict(ratio <= BAR_LAYER_RATIO)))
    sweep = results.get("sweep")
    if sweep:
        how = "median of %d runs" % sweep["runs"] if sweep["runs"] > 1 else "1 run"
        rows.append(("sweep, GPT-485B 24 layouts --jobs 2 (%s)" % how, "%.2f s" % sweep["median_s"],
                     "< %.0f s" % BAR_SWEEP_S, verdict(sweep["median_s"] < BAR_SWEEP_S)))
        rows.append(("sweep, peak RSS (max over runs)", mb(sweep["peak_rss_mb"]),
                     "< %.0f MB" % BAR_RSS_MB, verdict(sweep["peak_rss_mb"] < BAR_RSS_MB)))
        bars.append(("24-layout sweep < %.0f s" % BAR_SWEEP_S, "%.2f s" % sweep["median_s"],
                     verdict(sweep["median_s"] < BAR_SWEEP_S)))
    if layout:
        bars.append(("per-layout peak RSS < 1 GB", mb(layout["peak_rss_mb"]),
                     verdict(layout["peak_rss_mb"] < BAR_RSS_MB)))
        bars.append(("Llama-3-70B layout command <= %.1f s (128 microbatches, start and files "
                     "included)" % BAR_LAYOUT_COMMAND_S, "%.2f s" % layout["median_s"],
                     verdict(layout["median_s"] <= BAR_LAYOUT_COMMAND_S)))
        bars.append(("Llama-3-70B layout command <= %.0f MB peak RSS (128 microbatches)"
                     % BAR_LAYOUT_RSS_MB, mb(layout["peak_rss_mb"]),
                     verdict(layout["peak_rss_mb"] <= BAR_LAYOUT_RSS_MB)))
    commands = {r["microbatches"]: r for r in results.get("scaling") or []
                if r["kind"] == "microbatches"}
    if 128 in commands and 512 in commands:
        for key, what in (("wall_s", "wall"), ("peak_rss_mb", "peak RSS")):
            ratio = commands[512][key] / commands[128][key]
            bars.append(("Llama-3-70B command, 512 / 128 microbatches, %s <= %.1fx"
                         % (what, BAR_MICROBATCH_RATIO), "%.2fx" % ratio,
                         verdict(ratio <= BAR_MICROBATCH_RATIO)))
    if sweep:
        bars.append(("sweep peak RSS < 1 GB", mb(sweep["peak_rss_mb"]),
                     verdict(sweep["peak_rss_mb"] < BAR_RSS_MB)))
    return rows, bars


def scaling_rows(results):
    """Returns the scaling table's rows and a one-line reading of it."""
    scaling = results.get("scaling") or []
    rows = [(r["kind"].replace("_", " "), r["world_size"], r["world_size"] // 32, r["microbatches"],
             "%.2f s" % r["wall_s"], "%.0f MB" % r["peak_rss_mb"]) for r in scaling]
    by_mb = [r for r in scaling if r["kind"] == "microbatches"]
    by_ws = [r for r in scaling if r["kind"] == "world_size"]
    notes = []
    if len(by_mb) >= 2:
        first, last = by_mb[0], by_mb[-1]
        notes.append("microbatches x%.0f (%d -> %d): wall x%.1f, RSS x%.1f" % (
            last["microbatches"] / first["microbatches"], first["microbatches"],
            last["microbatches"], last["wall_s"] / first["wall_s"],
            last["peak_rss_mb"] / first["peak_rss_mb"]))
    if len(by_ws) >= 2:
        walls = [r["wall_s"] for r in by_ws]
        rss = [r["peak_rss_mb"] for r in by_ws]
        notes.append("world size x%.0f (%d -> %d): wall max/min %.2f, RSS max/min %.2f" % (
            by_ws[-1]["world_size"] / by_ws[0]["world_size"], by_ws[0]["world_size"],
            by_ws[-1]["world_size"], max(walls) / min(walls), max(rss) / min(rss)))
    return rows, "; ".join(notes)


SCALING_HEADERS = ["Scaling", "World size", "DP", "Microbatches", "Wall (1 run)", "Peak RSS"]


def text_table(rows, headers):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [fmt.format(*headers), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def md_table(rows, headers):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def write_markdown(path, info, results, rows, bars, args, failures, load_before, load_after,
                   total_s):
    cmd_layout = "build/memsim " + " ".join(LAYOUT_ARGS) + " --out <tmp>"
    cmd_sweep = "build/memsim " + " ".join(SWEEP_ARGS) + " --out <tmp>"
    layer = results.get("layer") or {}
    lines = [
        "# memsim benchmarks",
        "",
        "Generated by `/usr/bin/python3 benchmarks/run_benchmarks.py%s` (see "
        "[benchmarks/README.md](benchmarks/README.md) for what each number means)."
        % (" --quick" if args.quick else ""),
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        "| CPUs (`nproc`) | %s |" % info["nproc"],
        "| CPU | %s |" % info["cpu"],
        "| Memory | %s |" % info["memory"],
        "| OS | %s |" % info["os"],
        "| Date | %s |" % info["date"],
        "| Git commit | %s |" % info["commit"],
        "| Binaries | %s |" % info["binaries"],
        "| Load average (1/5/15 min) before / after | %s / %s |" % (load_before, load_after),
        "| Total run time | %.0f s |" % total_s,
        "",
    ]
    for warning in getattr(args, "warnings", []):
        lines += ["**Warning:** " + warning + ".", ""]
    if args.note:
        lines += ["**Note:** " + args.note, ""]
    lines += ["Where the time goes (callgrind and perf profiles, by hand): "
              "[benchmarks/PROFILE.md](benchmarks/PROFILE.md).", ""]
    if args.quick:
        lines += ["**Quick run** (`--quick`): fewer repetitions; use a full run for reference "
                  "numbers.", ""]
    if failures:
        lines += ["## Failures", ""] + ["- " + f for f in failures] + [""]
    lines += ["## Bars (from the issue)", "", md_table(bars, ["Bar", "Measured", "Result"]), "",
              "## Results", "", md_table(rows, ["Measurement", "Value", "Bar", "Result"]), ""]
    tracer = results.get("tracer")
    if layer and tracer:
        py = tracer
        lines += [
            "Per layer: one GPT layer (hidden 4096, seq 2048, 32 heads, bf16, micro batch 1, "
            "flash attention) forward + backward on meta tensors. memsim: `BM_GptLayer` in "
            "`build/memsim_bench` with full tracking (%.0f recorded events per layer); Python: "
            "`benchmarks/python_tracer.py`, the same layer in PyTorch %s under a "
            "`TorchDispatchMode` recording every op's output bytes (%.0f ops per layer), "
            "%s attention, measured in the same run."
            % (layer["attribution"]["events_per_layer"] or 0, py.get("torch", "?"),
               py["ops_per_layer"], py["attention"]),
            "",
        ]
    if results.get("tracer_layout"):
        lines += [
            "Whole layout: `benchmarks/python_tracer.py --layout llama70b --microbatches N` runs "
            "what a dispatch-mode tracer must run for memsim_bench's BM_Llama70bLayout (TP8 PP4, "
            "sequence parallel, sequence 8192): the 20 decoder layers of each of the 4 stages, "
            "forward and backward, for every microbatch, recording every op's output bytes "
            "(embedding, loss and optimizer step left out, which favours it); memsim's "
            "in-process median on one thread simulates all of it, with frees, attribution, the "
            "allocator model and the pipeline clock.",
            "",
        ]
    srows, sreading = scaling_rows(results)
    if srows:
        lines += ["## Scaling", "", md_table(srows, SCALING_HEADERS), "", sreading + ".", "",
                  "Expected: time and memory grow with the microbatches (every microbatch's "
                  "forward and backward is simulated and recorded) but not with the world size "
                  "(memsim simulates one rank per rank class; TP 8 x PP 4 gives 4 classes at "
                  "any DP).", ""]
    lines += [
        "Commands (`<tmp>` is a fresh temporary folder, removed afterwards):",
        "",
        "- per layout: `%s`" % cmd_layout,
        "- process start: `build/memsim --version`",
        "- in-process: `build/memsim_bench --benchmark_filter='BM_Llama70bLayout|BM_Gpt485bLayers'`"
        " (every rank class simulated in one process, no files written: what a search pays per "
        "layout; Llama-3-70B as the per-layout command with N microbatches on J threads, and the "
        "485B GPT on 8,192 GPUs, TP8 PP8, 96 microbatches, 24 or 96 layers)",
        "- sweep: `%s`" % cmd_sweep,
        "- scaling, microbatches: the per-layout command with `--num-microbatches N` instead of "
        "`--global-batch-size 512` (N = %s)" % ", ".join(map(str, SCALING_MICROBATCHES)),
        "- scaling, world size: the same with `--world-size W --num-microbatches %d` (W = %s; TP 8, "
        "PP 4, DP = W / 32); memsim simulates one rank per rank class, so the time should not grow "
        "with W" % (SCALING_FIXED_MICROBATCHES, ", ".join(map(str, SCALING_WORLD_SIZES))),
        "",
        "Wall time is measured around each process (output files included); peak RSS is the "
        "process's `ru_maxrss` (MB = 10^6 bytes). Scaling rows are single runs.",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Runs memsim's benchmarks and writes BENCHMARKS.md.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions (1 run per command, 50 Python iterations)")
    parser.add_argument("--output", default="BENCHMARKS.md",
                        help="Markdown report, relative to the repository root (default BENCHMARKS.md)")
    parser.add_argument("--note", default="", help="a remark to put at the top of the report")
    args = parser.parse_args(argv)
    args.warnings = []

    for path in (MEMSIM, MEMSIM_BENCH):
        if not os.access(os.path.join(REPO, path), os.X_OK):
            print("run_benchmarks: %s not found; build it first: cmake --build build -j1 --target "
                  "memsim memsim_bench" % path, file=sys.stderr)
            return 2

    info = machine_info()
    mtimes_before = binary_mtimes()
    load_before = loadavg()
    start = time.perf_counter()
    results, failures = {}, []
    tmp = tempfile.mkdtemp(prefix="memsim_bench_")
    try:
        steps = [("layer", lambda: measure_layer(args.quick, tmp)),
                 ("tracer", lambda: measure_tracer(args.quick, tmp)),
                 ("tracer_layout", lambda: measure_tracer_layout(args.quick, tmp)),
                 ("layout", lambda: measure_layout(args.quick)),
                 ("in_process", lambda: measure_in_process(tmp)),
                 ("sweep", lambda: measure_sweep(args.quick)),
                 ("scaling", lambda: measure_scaling(args.quick))]
        for name, fn in steps:
            try:
                results[name] = fn()
            except (RunError, OSError) as e:
                failures.append("%s: %s" % (name, e))
                log("run_benchmarks: %s failed: %s" % (name, e))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total_s = time.perf_counter() - start
    load_after = loadavg()
    try:
        rebuilt = [p for p, t in binary_mtimes().items() if t != mtimes_before[p]]
    except OSError:
        rebuilt = [MEMSIM, MEMSIM_BENCH]
    if rebuilt:
        warning = ("%s changed during the run (rebuilt?): the numbers mix two builds; run again"
                   % ", ".join(rebuilt))
        log("run_benchmarks: warning: " + warning)
        args.warnings.append(warning)

    rows, bars = build_rows(results)
    print(text_table(rows, ["Measurement", "Value", "Bar", "Result"]))
    print()
    srows, sreading = scaling_rows(results)
    if srows:
        print()
        print(text_table(srows, SCALING_HEADERS))
        print(sreading)
    print()
    print(text_table(bars, ["Bar", "Measured", "Result"]))
    for f in failures:
        print("FAILED: " + f)
    output = os.path.join(REPO, args.output) if not os.path.isabs(args.output) else args.output
    write_markdown(output, info, results, rows, bars, args, failures, load_before, load_after,
                   total_s)
    print("\nwrote %s (%.0f s)" % (args.output, total_s))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
