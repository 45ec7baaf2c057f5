#!/usr/bin/python3
"""The "Python way" baseline for memsim's BM_GptLayer benchmark.

One GPT layer (hidden 4096, sequence 2048, 32 heads, bf16, micro batch 1, dropout 0.1,
biases, [S, B, H] layout) written in plain PyTorch on meta tensors, run forward +
backward under a TorchDispatchMode that records every op's output sizes (nbytes) into
a list, the way fake-tensor memory tracers do. Timing mirrors the C++ benchmark: the
parameters are made once, then each iteration makes a fresh input, runs forward and
backward, and we report the median milliseconds per layer.

Attention: torch 1.13 has no torch.nn.functional.scaled_dot_product_attention.
  --attention flash (default): mimics FlashAttention like memsim's flash kernel does, as
      one autograd.Function whose forward makes the output [B, S, A, D] and the
      log-sum-exp [B, A, S] (fp32) and whose backward makes dq, dk, dv; with the same
      's b ... -> b s ...' transposes + contiguous copies around it as memsim/Megatron.
      This is the like-for-like comparison with BM_GptLayer (flash attention).
  --attention eager: Megatron's DotProductAttention: baddbmm -> softmax -> dropout -> bmm
      (materialises the [B*A, S, S] scores; more ops, for reference).

--layout llama70b: the whole layout instead of one layer, for memsim_bench's
  BM_Llama70bLayout (Llama-3-70B on TP8 PP4 with sequence parallelism, sequence 8192, micro
  batch 1): each of the 4 pipeline stages' 20 decoder layers (RMSNorm, GQA with 8 query and 1
  key-value head per rank, FlashAttention's stand-in, SwiGLU with 3584 = 28672 / 8 per rank,
  the sequence-parallel gathers and reduce-scatters as one op each), forward and backward for
  each of --microbatches microbatches: the work memsim's microbatch and layer replication
  avoid. Embedding, loss and optimizer step are left out, which favours the tracer. Prints
  one JSON line: {"seconds": ..., "layer_passes": ..., "ops": ...}.

Run with Debian's torch: /usr/bin/python3 benchmarks/python_tracer.py
Prints one JSON line: {"median_ms": ..., "ops_per_layer": ..., "iterations": ...}.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HIDDEN = 4096
SEQ = 2048
HEADS = 32
MICRO_BATCH = 1
DROPOUT = 0.1
DTYPE = torch.bfloat16
DEVICE = "meta"


class MemoryTracer(TorchDispatchMode):
    """Records (op name, total output bytes) of every dispatched op, as such tracers do."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        nbytes = 0
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                nbytes += t.numel() * t.element_size()
        self.events.append((func.__name__, nbytes))
        return out


class FlashAttention(torch.autograd.Function):
    """Shape-only stand-in for flash_attn's forward/backward kernels (q, k, v: [B, S, A, D])."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty((q.size(0), q.size(2), q.size(1)), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def param(*shape):
    return torch.nn.Parameter(torch.empty(*shape, dtype=DTYPE, device=DEVICE))


class GptLayer(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        h = HIDDEN
        self.attention = attention
        self.ln1_w, self.ln1_b = param(h), param(h)
        self.qkv_w, self.qkv_b = param(3 * h, h), param(3 * h)
        self.proj_w, self.proj_b = param(h, h), param(h)
        self.ln2_w, self.ln2_b = param(h), param(h)
        self.fc1_w, self.fc1_b = param(4 * h, h), param(4 * h)
        self.fc2_w, self.fc2_b = param(h, 4 * h), param(h)

    def core_attention(self, q, k, v):  # q, k, v: [S, B, A, D]
        s, b, a, d = q.shape
        if self.attention == "flash":
            qb, kb, vb = (t.transpose(0, 1).contiguous() for t in (q, k, v))
            out = FlashAttention.apply(qb, kb, vb)  # [B, S, A, D]
            return out.transpose(0, 1).contiguous().view(s, b, a * d)
        q3 = q.reshape(s, b * a, d).transpose(0, 1)
        k3 = k.reshape(s, b * a, d).transpose(0, 1)
        v3 = v.reshape(s, b * a, d).transpose(0, 1)
        buffer = torch.empty((b * a, s, s), dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(buffer, q3, k3.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(d))
        probs = F.dropout(torch.softmax(scores, dim=-1), DROPOUT, training=True)
        context = torch.bmm(probs, v3)  # [B*A, S, D]
        return context.view(b, a, s, d).permute(2, 0, 1, 3).contiguous().view(s, b, a * d)

    def forward(self, x):  # x: [S, B, H]
        s, b, h = x.shape
        d = h // HEADS
        ln = F.layer_norm(x, (h,), self.ln1_w, self.ln1_b)
        qkv = F.linear(ln, self.qkv_w, self.qkv_b).view(s, b, HEADS, 3 * d)
        q, k, v = qkv.split(d, dim=3)
        context = self.core_attention(q, k, v)
        attn = F.linear(context, self.proj_w)
        x = x + F.dropout(attn + self.proj_b, DROPOUT, training=True)
        ln = F.layer_norm(x, (h,), self.ln2_w, self.ln2_b)
        hid = F.gelu(F.linear(ln, self.fc1_w, self.fc1_b))
        out = F.linear(hid, self.fc2_w)
        return x + F.dropout(out + self.fc2_b, DROPOUT, training=True)


class LlamaLayer(torch.nn.Module):
    """A Llama-3-70B decoder layer's share on one of 8 tensor-parallel ranks, sequence parallel."""

    TP, HIDDEN, HEADS, KV_HEADS, FFN, SEQ = 8, 8192, 64, 8, 28672, 8192

    def __init__(self):
        super().__init__()
        h, d, tp = self.HIDDEN, self.HIDDEN // self.HEADS, self.TP
        self.heads, self.kv_heads = self.HEADS // tp, self.KV_HEADS // tp
        self.ln1_w, self.ln2_w = param(h), param(h)
        self.qkv_w = param((self.heads + 2 * self.kv_heads) * d, h)
        self.proj_w = param(h, self.heads * d)
        self.fc1_w = param(2 * self.FFN // tp, h)
        self.fc2_w = param(h, self.FFN // tp)

    def rms_norm(self, x, w):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w

    def gather(self, x):  # sequence-parallel all-gather: [S/tp, B, H] -> [S, B, H]
        return x.repeat(self.TP, 1, 1)

    def reduce_scatter(self, x):  # [S, B, H] -> [S/tp, B, H]
        return x.view(self.TP, x.size(0) // self.TP, *x.shape[1:]).sum(0)

    def forward(self, x):  # x: [S/tp, B, H]
        d = self.HIDDEN // self.HEADS
        ln = self.gather(self.rms_norm(x, self.ln1_w))
        s, b, _ = ln.shape
        qkv = F.linear(ln, self.qkv_w).view(s, b, self.kv_heads, -1)
        q, k, v = qkv.split([self.heads // self.kv_heads * d, d, d], dim=3)
        q = q.reshape(s, b, self.heads, d)
        q, k = q * 2.0, k * 2.0  # RoPE's stand-in: one new tensor each, as the fused kernel
        qb, kb, vb = (t.transpose(0, 1).contiguous() for t in (q, k, v))
        out = FlashAttention.apply(qb, kb, vb).transpose(0, 1).reshape(s, b, self.heads * d)
        x = x + self.reduce_scatter(F.linear(out, self.proj_w))
        h = F.linear(self.gather(self.rms_norm(x, self.ln2_w)), self.fc1_w)
        gate, up = h.chunk(2, dim=-1)
        return x + self.reduce_scatter(F.linear(F.silu(gate) * up, self.fc2_w))


def run_layout(microbatches, stages=4, layers_per_stage=20):
    """Every stage's layers, forward and backward, for every microbatch, under the tracer."""
    layers = [LlamaLayer() for _ in range(layers_per_stage)]
    tracer = MemoryTracer()
    shape = (LlamaLayer.SEQ // LlamaLayer.TP, MICRO_BATCH, LlamaLayer.HIDDEN)
    start = time.perf_counter()
    with tracer:
        for _ in range(stages):
            for _ in range(microbatches):
                x = torch.empty(shape, dtype=DTYPE, device=DEVICE, requires_grad=True)
                out = x
                for layer in layers:
                    out = layer(out)
                out.backward(torch.empty_like(out))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "microbatches": microbatches,
            "layer_passes": stages * layers_per_stage * microbatches, "ops": len(tracer.events),
            "torch": torch.__version__}


def step(layer, tracer):
    with tracer:
        x = torch.empty((SEQ, MICRO_BATCH, HIDDEN), dtype=DTYPE, device=DEVICE, requires_grad=True)
        out = layer(x)
        out.backward(torch.empty_like(out))
    return x.grad


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", choices=["flash", "eager"], default="flash")
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations")
    parser.add_argument("--iterations", type=int, default=300, help="timed iterations")
    parser.add_argument("--layout", choices=["llama70b"],
                        help="run a whole layout (see above) instead of timing one layer")
    parser.add_argument("--microbatches", type=int, default=8, help="with --layout")
    args = parser.parse_args(argv)

    torch.set_grad_enabled(True)
    if args.layout:
        print(json.dumps(run_layout(args.microbatches)))
        return 0
    layer = GptLayer(args.attention)
    tracer = MemoryTracer()
    for _ in range(args.warmup):
        step(layer, tracer)
    tracer.events.clear()
    times = []
    for _ in range(args.iterations):
        start = time.perf_counter()
        step(layer, tracer)
        times.append((time.perf_counter() - start) * 1e3)
    ops = len(tracer.events) / args.iterations
    print(json.dumps({
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "ops_per_layer": ops,
        "bytes_recorded_per_layer": sum(n for _, n in tracer.events) / args.iterations,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "attention": args.attention,
        "torch": torch.__version__,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
