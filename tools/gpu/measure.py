#!/usr/bin/env python3
"""Records, on a real CUDA GPU, what memsim models without one.

Run on a machine with a CUDA GPU and PyTorch 2.x (tools/gpu/README.md); each command
writes one JSON file that memsim's tests read as real measurements.

  measure.py allocator OUT.json EVENTS...   replays allocator event files
        (snapshot_events.py) through PyTorch's CUDA caching allocator: every change of
        reserved memory with the event index where it happened, the peaks, the final
        segments, and the same replay under a capped device (set_per_process_memory_fraction)
        with its retries and the event where it ran out of memory.
  measure.py workspaces OUT.json            cuBLAS/cuBLASLt workspaces: which (thread,
        stream) pairs get one, their size by default and under CUBLAS_WORKSPACE_CONFIG,
        and whether autograd's backward thread makes its own.
  measure.py ops OUT.json                   the outputs and in-op peaks of the ATen ops memsim
        gives CUDA-shaped meta kernels (ops/meta_kernels.cc, ops/transformer_kernels.cc).

Every byte count is what torch.cuda.memory_stats() reports; "requested" counts are the
callers' sizes before the allocator's 512-byte rounding.
"""
import gzip
import json
import os
import subprocess
import sys
import threading

import torch

MiB = 1 << 20


def stats():
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in (
        "allocated_bytes.all.current", "reserved_bytes.all.current",
        "requested_bytes.all.current", "num_alloc_retries", "num_ooms",
        "segment.all.current")}


def device_info():
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
            "total_memory": torch.cuda.mem_get_info()[1], "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def write_json(path, value):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# allocator


def read_events(path):
    opener = gzip.open if path.endswith(".gz") else open
    events = []
    with opener(path, "rt") as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            kind, _, arg = line.strip().partition(" ")
            events.append((kind, int(arg) if arg.strip() else 0))
    return events


def replay(events):
    """Replays `events` on a fresh allocator state; returns what it saw.

    The caller must have freed everything and emptied the cache before."""
    torch.cuda.reset_peak_memory_stats()
    start = stats()
    assert start["allocated_bytes.all.current"] == 0, "replay needs an empty allocator"
    assert start["reserved_bytes.all.current"] == 0, "replay needs an emptied cache"
    live = {}
    reserved = 0
    changes = []  # [event index, reserved bytes after it]
    # Where cudaMalloc put each new segment (an allocation that makes one sits at its
    # front), in order; PyTorch breaks ties between equal-size free blocks by address, so a
    # model needs these to replay exactly. Counted by segment.all.allocated, not by reserved
    # memory, which stays put when the cache releases as much as the segment takes.
    new_segment_addresses = []
    segments_made = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    oom_event = -1
    retries_before = start["num_alloc_retries"]
    allocations = 0
    for i, (kind, arg) in enumerate(events):
        if kind == "a":
            try:
                live[allocations] = torch.empty(arg, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                oom_event = i
                break
            allocations += 1
        elif kind == "f":
            del live[arg]
        elif kind == "e":
            torch.cuda.empty_cache()
        if kind == "a":
            made = torch.cuda.memory_stats().get("segment.all.allocated", 0)
            if made != segments_made:
                new_segment_addresses.append(live[allocations - 1].data_ptr())
                segments_made = made
        now = torch.cuda.memory_reserved()
        if now != reserved:
            changes.append([i, now])
            reserved = now
    end = torch.cuda.memory_stats()
    result = {
        "events": len(events), "oom_event": oom_event, "reserved_changes": changes,
        "new_segment_addresses": new_segment_addresses,
        "peak_allocated_bytes": end["allocated_bytes.all.peak"],
        "peak_reserved_bytes": end["reserved_bytes.all.peak"],
        "peak_requested_bytes": end.get("requested_bytes.all.peak", 0),
        "allocated_bytes_at_end": end["allocated_bytes.all.current"],
        "reserved_bytes_at_end": end["reserved_bytes.all.current"],
        "num_alloc_retries": end["num_alloc_retries"] - retries_before,
        "segments_at_end": sorted(
            [s["total_size"], s["segment_type"]] for s in torch.cuda.memory_snapshot()),
        "segment_addresses_at_end": sorted(
            [s["address"], s["total_size"]] for s in torch.cuda.memory_snapshot()),
    }
    live.clear()
    torch.cuda.empty_cache()
    return result


def measure_allocator(out_path, event_paths):
    total = torch.cuda.mem_get_info()[1]
    result = {"device": device_info(), "sequences": {}}
    for path in event_paths:
        name = os.path.basename(path).split(".events")[0]
        events = read_events(path)
        free = replay(events)
        entry = {"unlimited": free}
        # Capped devices: between the peak allocated and the peak reserved the allocator
        # must release its cache and retry; just above the peak allocated it may run out.
        peak_alloc, peak_reserved = free["peak_allocated_bytes"], free["peak_reserved_bytes"]
        caps = {}
        if peak_reserved > peak_alloc:
            caps["midway"] = peak_alloc + (peak_reserved - peak_alloc) // 2
        caps["tight"] = peak_alloc + 2 * MiB
        for label, cap in caps.items():
            fraction = cap / total
            torch.cuda.set_per_process_memory_fraction(fraction)
            # PyTorch caps at static_cast<size_t>(fraction * device_total).
            run = replay(events)
            run["fraction"] = fraction
            run["allowed_bytes"] = int(fraction * total)
            entry["capped_" + label] = run
        torch.cuda.set_per_process_memory_fraction(1.0)
        result["sequences"][name] = entry
        print(f"{name}: {len(events)} events, peak reserved "
              f"{peak_reserved / MiB:.1f} MiB, allocated {peak_alloc / MiB:.1f} MiB", flush=True)
    write_json(out_path, result)


# ---------------------------------------------------------------------------------------
# workspaces

# What both probes share: step(label, fn) runs fn and records the blocks it left allocated
# and those it freed (from the allocator's snapshot) and the change of allocated bytes.
PROBE_PRELUDE = r"""
import json, threading, torch
from collections import Counter
def blocks():
    return Counter(b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                   if b["state"] == "active_allocated")
steps = []
def step(label, fn):
    before, allocated = blocks(), torch.cuda.memory_allocated()
    fn(); torch.cuda.synchronize()
    after = blocks()
    steps.append({"step": label, "allocated_delta": torch.cuda.memory_allocated() - allocated,
                  "new_blocks": sorted((after - before).elements()),
                  "freed_blocks": sorted((before - after).elements())})
"""

WORKSPACE_PROBE = PROBE_PRELUDE + r"""
a = torch.ones(1024, 1024, dtype=torch.bfloat16, device="cuda")
b = torch.ones(1024, 1024, dtype=torch.bfloat16, device="cuda")
bias = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
keep = []
step("first bf16 mm, main thread", lambda: keep.append(a @ b))
step("second bf16 mm, main thread", lambda: keep.append(a @ b))
step("fp32 mm, main thread", lambda: keep.append(a.float() @ b.float()))
step("addmm with bias (cuBLASLt), main thread",
     lambda: keep.append(torch.addmm(bias, a, b)))
step("linear with bias, main thread",
     lambda: keep.append(torch.nn.functional.linear(a, b, bias)))
side = torch.cuda.Stream()
def on_side():
    with torch.cuda.stream(side):
        keep.append(a @ b)
step("bf16 mm on a second stream, main thread", on_side)
def in_thread():
    t = threading.Thread(target=lambda: keep.append(a @ b)); t.start(); t.join()
step("bf16 mm in a new thread", in_thread)
x = torch.ones(256, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
w = torch.ones(1024, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
def backward():
    (x @ w).sum().backward()
step("forward + backward of x @ w (autograd's device thread)", backward)
print(json.dumps(steps))
"""


# In a fresh process, as a training step meets them: a forward GEMM on the main thread,
# then autograd's backward (its own device thread; cuBLAS handles are pooled per thread,
# so no other thread may have run a GEMM first), then a linear with bias (cuBLASLt).
TRAINING_PROBE = PROBE_PRELUDE + r"""
x = torch.ones(256, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
w = torch.ones(1024, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
bias = torch.ones(1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
keep = []
step("forward x @ w, main thread", lambda: keep.append(x @ w))
step("backward of it (autograd's device thread)", lambda: keep.pop().sum().backward())
step("forward linear with bias", lambda: keep.append(torch.nn.functional.linear(x, w, bias)))
step("backward of it", lambda: keep.pop().sum().backward())
print(json.dumps(steps))
"""


def run_workspace_probe(env_extra, probe=WORKSPACE_PROBE):
    env = dict(os.environ)
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_workspaces(out_path):
    result = {"device": device_info(), "runs": {}}
    for label, env in (("default", {}),
                       ("CUBLAS_WORKSPACE_CONFIG=:4096:8", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
                       ("CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8",
                        {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}),
                       ("TORCH_CUBLASLT_UNIFIED_WORKSPACE=0",
                        {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"})):
        result["runs"][label] = run_workspace_probe(env)
        print("workspaces", label, json.dumps(result["runs"][label])[:600], flush=True)
    for label, env in (("training step", {}), ("training step, TORCH_CUBLASLT_UNIFIED_WORKSPACE=0",
                                               {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"})):
        result["runs"][label] = run_workspace_probe(env, TRAINING_PROBE)
        print("workspaces", label, json.dumps(result["runs"][label]), flush=True)
    write_json(out_path, result)


# ---------------------------------------------------------------------------------------
# ops


def start_history():
    """Records allocator actions from now on, forgetting earlier ones."""
    try:
        torch.cuda.memory._record_memory_history(max_entries=100000, context=None,
                                                 stacks="python", clear_history=True)
    except TypeError:  # a PyTorch without clear_history
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.memory._record_memory_history(max_entries=100000, context=None,
                                                 stacks="python")


def op_record(label, fn, *inputs):
    """Runs fn(*inputs) and records its outputs and its peak above the inputs."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    start_history()
    try:
        out = fn(*inputs)
    except Exception as e:  # an op or backend this GPU or build lacks
        torch.cuda.memory._record_memory_history(enabled=None)
        return {"op": label, "error": str(e)[:300]}
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    # Every allocation and free inside the op, in order (sizes as requested).
    trace = [[t["action"], t["size"]] for t in torch.cuda.memory._snapshot()["device_traces"][0]
             if t["action"] in ("alloc", "free_completed")]
    torch.cuda.memory._record_memory_history(enabled=None)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    record = {
        "op": label,
        "inputs": [[str(t.dtype), list(t.shape)] for t in inputs if torch.is_tensor(t)],
        "outputs": [[str(t.dtype), list(t.shape), t.untyped_storage().nbytes()]
                    for t in outs if torch.is_tensor(t)],
        "retained_requested_bytes": after["requested_bytes.all.current"]
        - before["requested_bytes.all.current"],
        "peak_requested_above_inputs_bytes": after["requested_bytes.all.peak"]
        - before["requested_bytes.all.current"],
        "retained_allocated_bytes": after["allocated_bytes.all.current"]
        - before["allocated_bytes.all.current"],
        "peak_allocated_above_inputs_bytes": after["allocated_bytes.all.peak"]
        - before["allocated_bytes.all.current"],
        "trace": trace,
    }
    del out, outs
    return record


def measure_ops(out_path):
    torch.manual_seed(0)
    dev = "cuda"
    bf16 = torch.bfloat16
    S, B, H, V = 2048, 4, 2048, 50304
    records = []
    aten = torch.ops.aten
    # None of these ops runs a GEMM, so no cuBLAS workspace lands inside a measurement.
    x = torch.randn(S, B, H, dtype=bf16, device=dev)
    w = torch.ones(H, dtype=bf16, device=dev)
    bias = torch.zeros(H, dtype=bf16, device=dev)
    records.append(op_record("native_layer_norm bf16",
                             lambda x: aten.native_layer_norm(x, [H], w, bias, 1e-5), x))
    y, mean, rstd = aten.native_layer_norm(x, [H], w, bias, 1e-5)
    dy = torch.randn_like(y)
    records.append(op_record(
        "native_layer_norm_backward bf16",
        lambda dy: aten.native_layer_norm_backward(dy, x, [H], mean, rstd, w, bias,
                                                   [True, True, True]), dy))
    del y, mean, rstd
    records.append(op_record("native_dropout p=0.1 bf16",
                             lambda x: aten.native_dropout(x, 0.1, True), x))
    out, mask = aten.native_dropout(x, 0.1, True)
    records.append(op_record("native_dropout_backward bf16",
                             lambda dy: aten.native_dropout_backward(dy, mask, 1 / 0.9), dy))
    del out, mask, dy
    weight = torch.randn(V, H, dtype=bf16, device=dev)
    tokens = torch.randint(0, V, (B, S), device=dev)
    records.append(op_record("embedding bf16", lambda t: aten.embedding(weight, t), tokens))
    records.append(op_record("index_select bf16",
                             lambda t: aten.index_select(weight, 0, t.reshape(-1)), tokens))
    grad = torch.randn(B, S, H, dtype=bf16, device=dev)
    records.append(op_record(
        "embedding_dense_backward bf16",
        lambda g: aten.embedding_dense_backward(g, tokens, V, -1, False), grad))
    del weight, grad
    # Its temporaries scale with tokens and hidden size: more shapes.
    # (Up to 3072 tokens the kernel takes its atomic path.)
    for tokens_n, hidden, vocab in ((4096, 1024, 32000), (16384, 4096, 128256),
                                    (32768, 1024, 50304), (3072, 1024, 32000),
                                    (3073, 1024, 32000)):
        idx = torch.randint(0, vocab, (tokens_n,), device=dev)
        g = torch.randn(tokens_n, hidden, dtype=bf16, device=dev)
        records.append(op_record(
            f"embedding_dense_backward bf16 tokens={tokens_n} hidden={hidden} vocab={vocab}",
            lambda g: aten.embedding_dense_backward(g, idx, vocab, -1, False), g))
        del idx, g
    records.append(op_record("relu bf16", lambda x: aten.relu(x), x))
    cond = torch.rand(S, B, H, device=dev) > 0.5
    records.append(op_record("where.self bf16", lambda c: aten.where(c, x, x), cond))
    del cond
    records.append(op_record("roll bf16 dim 0", lambda x: aten.roll(x, [1], [0]), x))
    xt = x.transpose(0, 1)
    records.append(op_record("roll bf16 non-contiguous", lambda t: aten.roll(t, [1], [0]), xt))
    del xt, x
    # FlashAttention through PyTorch's SDPA (FlashAttention-2 kernels, [B, heads, S, D]).
    heads, D = 16, 128
    q = torch.randn(B, heads, S, D, dtype=bf16, device=dev, requires_grad=True)
    k = torch.randn(B, heads, S, D, dtype=bf16, device=dev, requires_grad=True)
    v = torch.randn(B, heads, S, D, dtype=bf16, device=dev, requires_grad=True)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    records.append(op_record("sdpa flash forward causal",
                             lambda q: aten._scaled_dot_product_flash_attention(
                                 q, kd, vd, 0.0, True), qd))
    for backend in ("cudnn", "efficient"):
        fwd = getattr(aten, f"_scaled_dot_product_{backend}_attention")
        records.append(op_record(f"sdpa {backend} forward causal",
                                 lambda q: fwd(q, kd, vd, None, True, 0.0, True), qd))
    try:
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            do = torch.randn_like(o)
            records.append(op_record(
                "sdpa flash backward causal (q, k, v grads)",
                lambda do: torch.autograd.grad(o, (q, k, v), do), do))
    except Exception as e:
        records.append({"op": "sdpa flash backward causal", "error": str(e)[:300]})
    write_json(out_path, {"device": device_info(), "ops": records})
    for r in records:
        print(json.dumps(r)[:400], flush=True)


def main(argv):
    if len(argv) < 3 or argv[1] not in ("allocator", "workspaces", "ops"):
        sys.exit(__doc__)
    if not torch.cuda.is_available():
        sys.exit("measure.py: no CUDA device; run it on a machine with a GPU")
    if argv[1] == "allocator":
        measure_allocator(argv[2], argv[3:])
    elif argv[1] == "workspaces":
        measure_workspaces(argv[2])
    else:
        measure_ops(argv[2])


if __name__ == "__main__":
    main(sys.argv)
