#!/usr/bin/env python3
"""Runs one rank of a validation case's Megatron-LM training on a single GPU and records
what PyTorch's caching allocator saw.

Megatron-LM's --fake-process-group (megatron/training/initialize.py) initialises
torch.distributed with PyTorch's fake backend: every collective and point-to-point
operation returns at once, but each rank's own tensors, including the buffers those
operations write into, are allocated as in a real run. Set WORLD_SIZE and RANK to the
case's and one GPU runs the rank the case measured, with the real Megatron-Core code
path, the real CUDA kernels and the real caching allocator. Communication libraries'
own buffers (NCCL) are outside PyTorch's allocator in a real run too.

Limits, which the results must be read with:
  * Transformer Engine is not installed on the GPU machines memsim's sessions get, so only
    cases with --transformer-impl local run;
  * received tensors hold whatever the allocator's block held before (nothing is sent), so
    data-dependent sizes (MoE routing) follow garbage, not the real run's tokens;
  * without Transformer Engine and Apex, Megatron falls back to PyTorch for Adam (made
    fused here, as FusedAdam is), layer norm, the masked softmax and the norms it logs;
  * with tensor parallelism, a rank other than its group's first builds no dataset and
    learns do_train from rank 0's broadcast, which the fake backend leaves zero: run_inner
    sets do_train itself and zero-fills what such ranks receive by broadcast (their batch),
    with which a TP2 run's rank 1 trained (2026-11-27);
  * PyTorch's layer norm refuses sequence parallelism, so no case with it runs;
  * Megatron-FSDP does not run: its DTensor checks read chunk metadata the fake backend's
    all-gather leaves unset ("DTensor chunk metadata is invalid", 2026-11-28);
  * Megatron-Core 0.20's CheckpointWithoutOutput names Transformer Engine's FP8 state
    whether or not FP8 is on (a NameError without TE): run_inner supplies stand-ins;
  * allocations PyTorch's NCCL process group makes inside a collective (flattening lists)
    are skipped with the collective;
  * fp16 runs skip their first optimizer steps (dynamic loss scale overflows) and create
    Adam's states late: run enough iterations to pass them;
  * the data are Megatron's mock dataset (--mock-data, NullTokenizer with the case's
    vocabulary size), not the case's files; checkpoints are neither loaded nor saved.

Usage (on the GPU machine, from the repository root):
  megatron_fake_pg.py MEGATRON_DIR OUT_DIR CASE.yaml[:ITERATIONS]... [--iterations N]
(a case written CASE.yaml:30 runs 30 iterations, others --iterations)
Writes OUT_DIR/megatron_fake_pg.json (one entry per case: the launch line run, memory after
every optimizer step, the cumulative peak, the first error), OUT_DIR/NAME.trace.json.gz
per case (the allocator's history with each event's Megatron and PyTorch frames) and
OUT_DIR/memory_trace_rank{R}_NAME.json (the run in Megatron's memory-tracer schema, each
train_step an iteration, for `memsim compare`; first run on an H200 on 2026-11-28).
"""
import argparse
import bisect
import gzip
import json
import os
import re
import runpy
import subprocess
import sys
import time

# Arguments that name files, checkpoints or schedules memsim's run does not have; each is
# replaced by what the fake run uses or dropped (no GPU memory depends on them).
# --ckpt-format stays: argument checks read it (Megatron-FSDP asserts fsdp_dtensor), and
# with nothing saved or loaded it moves no memory.
DROPPED = {
    "--save", "--load", "--data-path", "--vocab-file", "--merge-file", "--split",
    "--data-cache-path", "--async-save", "--use-persistent-ckpt-worker", "--train-iters",
    "--eval-interval", "--eval-iters", "--save-interval", "--tensorboard-dir",
    "--dist-ckpt-strictness", "--dist-ckpt-optim-fully-reshardable",
    "--use-checkpoint-opt_param-scheduler", "--tokenizer-type", "--tokenizer-model",
    "--exit-interval", "--auto-detect-ckpt-format", "--finetune", "--no-load-optim",
    "--no-load-rng",
}


HISTORY_ENTRIES = 2_000_000  # the allocator history's ring buffer


def launch_line(case, iterations, tensorboard_dir):
    argv = []
    for key, value in case["args"].items():
        if key in DROPPED:
            continue
        if value is True:
            argv.append(key)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [key] + [str(v) for v in value]
        else:
            argv += [key, str(value)]
    # GPT-2's BPE vocabulary (the CI's vocab.json) has 50257 entries; NullTokenizer's is
    # --vocab-size, which cases that use NullTokenizer already name.
    vocab = case["args"].get("--vocab-size", 50257)
    argv = [a for i, a in enumerate(argv) if a != "--vocab-size" and
            (i == 0 or argv[i - 1] != "--vocab-size")]
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(vocab), "--fake-process-group",
             # Apex's persistent layer norm kernel and Transformer Engine's fused rotary
             # embedding are absent; PyTorch's keep the same tensors.
             "--no-persist-layer-norm", "--no-rope-fusion",
             "--train-iters", str(iterations), "--eval-iters", "0",
             "--eval-interval", "1000000", "--tensorboard-dir", tensorboard_dir]
    return argv


def compact_trace(snapshot):
    """The allocator's events with their frames deduplicated: frames[i] is a list of
    'file:line:function' strings (Megatron's and PyTorch's Python frames, innermost first);
    events are [action, bytes, address, frames index]."""
    frames, frame_index, events = [], {}, []
    keep = ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "oom")
    for trace in snapshot.get("device_traces", []):
        for e in trace:
            if e["action"] not in keep:
                continue
            stack = []
            for f in e.get("frames", []):
                name = f.get("filename", "")
                if "megatron" in name or "pretrain_gpt" in name or "/torch/" in name:
                    short = re.sub(r".*/(megatron|torch)/", r"\1/", name)
                    stack.append(f"{short}:{f.get('line', 0)}:{f.get('name', '')}")
                if len(stack) >= 24:
                    break
            key = tuple(stack)
            if key not in frame_index:
                frame_index[key] = len(frames)
                frames.append(stack)
            events.append([e["action"], e["size"], e["addr"], frame_index[key]])
    return {"frames": frames, "events": events}


def iteration_trace(snapshot, steps, max_entries, bins=2000):
    """The run in the schema of Megatron-LM's memory tracer that `memsim compare` reads
    ({"<iteration>": {"samples": [{timestamp_s, allocated_memory_MB, reserved_memory_MB}],
    "peak_allocated_MB"}}), one entry per train_step (its wall-clock window, `steps`' start_us
    and end_us), from the allocator's history: allocated is the requested bytes of live
    blocks (memory_allocated counts them rounded to 512 bytes), reserved the segments. Each
    iteration starts with the state at its start, then keeps every change of reserved memory
    and the lowest and highest sample of each of `bins` equal time slices, so every extreme
    survives; iterations are numbered from 0, as memsim numbers its own. The history must
    cover the whole run (it starts before Megatron allocates anything): a history that
    filled its `max_entries` may have dropped its start, and is refused."""
    events = []
    for trace in snapshot.get("device_traces", []):
        if len(trace) >= max_entries:
            raise ValueError(f"the allocator history filled its {max_entries} entries")
        events += [e for e in trace if "time_us" in e]
    events.sort(key=lambda e: e["time_us"])
    growth = {"alloc": 1, "free_completed": -1}
    segment = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    allocated = reserved = 0
    timeline = []  # (time_us, allocated, reserved) after each event, in time order
    for e in events:
        allocated += growth.get(e["action"], 0) * e["size"]
        reserved += segment.get(e["action"], 0) * e["size"]
        timeline.append((e["time_us"], allocated, reserved))
    times = [t[0] for t in timeline]
    out = {}
    mib = 1024 * 1024
    for number, step in enumerate(steps):
        start, end = step["start_us"], step["end_us"]
        first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        window = timeline[first:last]
        if not window:
            raise ValueError(f"no allocator event inside train_step {number}'s window")
        width = max((end - start) / bins, 1)
        kept = {}
        for t in window:
            b = int((t[0] - start) // width)
            low, high = kept.get(b, (t, t))
            kept[b] = (t if t[1] < low[1] else low, t if t[1] > high[1] else high)
        samples = {x for pair in kept.values() for x in pair}
        samples |= {t for prev, t in zip(window, window[1:]) if t[2] != prev[2]}
        if first > 0:  # the state at the step's start
            samples.add((start, timeline[first - 1][1], timeline[first - 1][2]))
        samples = sorted(samples)
        out[str(number)] = {
            "samples": [{"timestamp_s": (t - start) / 1e6, "allocated_memory_MB": a / mib,
                         "reserved_memory_MB": r / mib} for t, a, r in samples],
            "peak_allocated_MB": max(a for _, a, _ in window) / mib,
        }
    return out


def run_inner(megatron_dir, case_path, out_dir, iterations):
    """Runs in the child process: pretrain_gpt.py as __main__, with train_step wrapped."""
    import yaml
    import torch

    with open(case_path) as f:
        case = yaml.safe_load(f)
    name = case["name"]
    result = {"case": name, "steps": [], "error": ""}
    os.makedirs("/tmp/fake_pg_tb", exist_ok=True)
    argv = launch_line(case, iterations, f"/tmp/fake_pg_tb/{name}")
    result["argv"] = argv
    sys.path.insert(0, megatron_dir)
    # Without Transformer Engine or Apex, Megatron's Adam is torch.optim.AdamW, whose
    # default (foreach) implementation makes full-size temporaries that FusedAdam does not;
    # the fused one updates in place, as FusedAdam does.
    import torch.optim

    class FusedAdamW(torch.optim.AdamW):
        def __init__(self, params, *a, **k):
            k.setdefault("fused", True)
            super().__init__(params, *a, **k)

    torch.optim.AdamW = FusedAdamW
    # Megatron-Core 0.20's CheckpointWithoutOutput (the layernorm, moe_act and mla_up_proj
    # recompute modules) always takes its FP8 branch (`self.fp8 = fp8 is not None`), which
    # names Transformer Engine's FP8GlobalStateManager: without TE, a NameError. Stand-ins
    # answer what TE answers with FP8 off.
    import contextlib
    import megatron.core.tensor_parallel.random as megatron_random

    if not megatron_random.HAVE_TE:
        class Fp8Off:
            is_fp8_enabled = staticmethod(lambda: False)
            get_fp8_recipe = staticmethod(lambda: None)

        megatron_random.FP8GlobalStateManager = Fp8Off
        megatron_random.activation_recompute_forward = lambda **k: contextlib.nullcontext()
        megatron_random.fp8_autocast = lambda **k: contextlib.nullcontext()
        # Multi-token prediction asks isinstance() of inference layers that are None
        # without Transformer Engine (a TypeError); a training run has none of them.
        import megatron.core.transformer.multi_token_prediction as mtp

        mtp.is_inference_column_parallel_linear = lambda module: False
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="python", max_entries=HISTORY_ENTRIES)
    try:
        import megatron.training.training as training

        original = training.train_step

        def recorded_train_step(*a, **k):
            torch.cuda.synchronize()
            start_us = time.time_ns() // 1000
            out = original(*a, **k)
            torch.cuda.synchronize()
            result["steps"].append({
                "start_us": start_us,
                "end_us": time.time_ns() // 1000,
                "allocated_bytes": torch.cuda.memory_allocated(),
                "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                "reserved_bytes": torch.cuda.memory_reserved(),
            })
            return out

        training.train_step = recorded_train_step

        # Tensor-parallel ranks other than 0 build no dataset and learn do_train from rank
        # 0's broadcast, which the fake backend does not deliver: the run would end after
        # setup. They train on the tensors get_batch receives (zeros, of the right shapes).
        original_loaders = training.build_train_valid_test_data_loaders

        def loaders_that_train(*a, **k):
            out = original_loaders(*a, **k)
            args = training.get_args()
            args.do_train = bool(args.do_train or (args.train_iters or 0) > 0)
            return out

        training.build_train_valid_test_data_loaders = loaders_that_train

        # What those ranks receive (tokens, labels, loss mask) would be whatever the
        # allocator's block held before, NaN and out-of-vocabulary labels included; zeros
        # (an empty loss mask) keep every op and every tensor of the step and no NaN check
        # fires. Filling in place allocates nothing.
        import torch.distributed as dist

        original_broadcast = dist.broadcast

        def broadcast_received_as_zeros(tensor, src=None, *a, **k):
            out = original_broadcast(tensor, src, *a, **k)
            if dist.get_rank() != src:
                tensor.zero_()
            return out

        dist.broadcast = broadcast_received_as_zeros
        sys.argv = [os.path.join(megatron_dir, "pretrain_gpt.py")] + argv
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            result["error"] = f"SystemExit({e.code})"
    except BaseException as e:  # recorded, then reported by the parent
        import traceback

        result["error"] = "".join(traceback.format_exception(e))[-4000:]
    stats = torch.cuda.memory_stats()
    result["memory_stats"] = {k: stats.get(k, 0) for k in (
        "allocated_bytes.all.peak", "allocated_bytes.all.current",
        "reserved_bytes.all.peak", "reserved_bytes.all.current",
        "requested_bytes.all.peak", "num_alloc_retries", "segment.all.peak")}
    snapshot = torch.cuda.memory._snapshot()
    trace = compact_trace(snapshot)
    try:
        memory_trace = iteration_trace(snapshot, result["steps"], HISTORY_ENTRIES)
        trace_name = f"memory_trace_rank{case['rank']}_{name.split('@')[0]}.json"
        with open(os.path.join(out_dir, trace_name), "w") as f:
            json.dump(memory_trace, f)
    except (ValueError, KeyError) as e:
        result["memory_trace_error"] = repr(e)
    with gzip.open(os.path.join(out_dir, f"{name}.trace.json.gz"), "wt") as f:
        json.dump(trace, f)
    result["trace_events"] = len(trace["events"])
    with open(os.path.join(out_dir, f"{name}.result.json"), "w") as f:
        json.dump(result, f, indent=1)


def make_stub(stub_dir, module):
    """A stand-in for a module Megatron imports unconditionally but never uses in these
    runs: every attribute is a callable placeholder."""
    parts = module.split(".")
    path = os.path.join(stub_dir, *parts[:-1])
    os.makedirs(path, exist_ok=True)
    for i in range(1, len(parts)):
        init = os.path.join(stub_dir, *parts[:i], "__init__.py")
        if not os.path.exists(init):
            with open(init, "w") as f:
                f.write(STUB)
    target = os.path.join(path, parts[-1] + ".py") if len(parts) > 1 else \
        os.path.join(stub_dir, parts[0] + ".py")
    with open(target, "w") as f:
        f.write(STUB)


STUB = '''
class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder
class _Placeholder(metaclass=_Meta):
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Placeholder()
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder
'''


def case_and_iterations(case_spec, default_iterations):
    """`CASE.yaml:30` -> (CASE.yaml, 30); a spec without a `:COUNT` suffix (a colon elsewhere
    in the path included) runs `default_iterations`."""
    case_path, _, count = case_spec.rpartition(":")
    if case_path and re.fullmatch(r"[0-9]+", count) and int(count) > 0:
        return case_path, int(count)
    return case_spec, default_iterations


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("megatron_dir")
    parser.add_argument("out_dir")
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--inner", action="store_true")
    parser.add_argument("--timeout", type=int, default=150, help="seconds a case may take")
    parser.add_argument("--budget", type=int, default=100000,
                        help="seconds for all cases; cases that would start after it are skipped")
    args = parser.parse_args()
    if args.inner:
        run_inner(args.megatron_dir, args.cases[0], args.out_dir, args.iterations)
        return
    os.makedirs(args.out_dir, exist_ok=True)
    stub_dir = "/tmp/fake_pg_stubs"
    os.makedirs(stub_dir, exist_ok=True)
    stubs, results = [], []
    deadline = time.time() + args.budget
    for case_spec in args.cases:
        case_path, iterations = case_and_iterations(case_spec, args.iterations)
        if time.time() > deadline - 20:
            print(f"{case_path}: skipped, the budget of {args.budget} s is spent", flush=True)
            continue
        import yaml

        with open(case_path) as f:
            case = yaml.safe_load(f)
        env = dict(os.environ)
        env.update({k: str(v) for k, v in (case.get("env") or {}).items()})
        env.update({"WORLD_SIZE": str(case["world_size"]), "RANK": str(case["rank"]),
                    "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29511",
                    "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": stub_dir + os.pathsep + env.get("PYTHONPATH", "")})
        result_path = os.path.join(args.out_dir, f"{case['name']}.result.json")
        for attempt in range(8):
            if os.path.exists(result_path):
                os.remove(result_path)  # a result left by an earlier run is not this one's
            start = time.time()
            cmd = [sys.executable, __file__, args.megatron_dir, args.out_dir, case_path,
                   "--inner", "--iterations", str(iterations)]
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                   timeout=max(10, min(args.timeout, deadline - time.time())))
                log, code = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as e:
                log = (e.stdout or b"").decode(errors="replace") + \
                    (e.stderr or b"").decode(errors="replace")
                code = "timeout"
            seconds = round(time.time() - start, 1)
            result = {"case": case["name"], "error": f"no result (exit {code})"}
            if os.path.exists(result_path):
                with open(result_path) as f:
                    result = json.load(f)
            # Only a module whose absence stopped the run is stubbed: one Megatron imports
            # inside try/except (Transformer Engine, Apex) must stay absent.
            missing = re.findall(r"ModuleNotFoundError: No module named '([A-Za-z0-9_.]+)'",
                                 result.get("error", ""))
            if missing and missing[-1] not in stubs and not result.get("steps"):
                stubs.append(missing[-1])
                make_stub(stub_dir, missing[-1])
                print(f"{case['name']}: stubbing {missing[-1]} and retrying", flush=True)
                continue
            break
        result.update({"exit": code, "seconds": seconds, "stubs": list(stubs),
                       "measured": case.get("measured"), "log_tail": log[-6000:]})
        with open(os.path.join(args.out_dir, f"{case['name']}.log"), "w") as f:
            f.write(log[-200000:])
        results.append(result)
        last = result["steps"][-1] if result.get("steps") else {}
        print(f"{case['name']}: {seconds} s, exit {code}, {len(result.get('steps', []))} "
              f"steps, last {last}, error {result.get('error', '')[-300:]!r}", flush=True)
        with open(os.path.join(args.out_dir, "megatron_fake_pg.json"), "w") as f:
            json.dump({"results": results}, f, indent=1)


if __name__ == "__main__":
    main()
