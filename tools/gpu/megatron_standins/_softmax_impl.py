"""PyTorch stand-ins for Megatron's fused softmax CUDA extensions (Apex's
scaled_*softmax_cuda), for GPU machines without them. Memory is what the kernels keep:
forward returns a new tensor of the input's dtype, backward writes into output_grads and
returns it; the float32 work is done in small chunks so its temporaries stay small."""
import math

import torch

CHUNKS = 32


def _rows(t):
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def softmax(inputs, scale, mask_rows=None):
    out = torch.empty_like(inputs)
    x, o = _rows(inputs), _rows(out)
    step = max(1, math.ceil(x.shape[0] / CHUNKS))
    for i in range(0, x.shape[0], step):
        t = x[i:i + step].float() * float(scale)
        if mask_rows is not None:
            t.masked_fill_(mask_rows(i, min(i + step, x.shape[0])), -10000.0)
        o[i:i + step] = torch.softmax(t, -1).to(out.dtype)
    return out


def backward(output_grads, softmax_results, scale):
    g_all, y_all = _rows(output_grads), _rows(softmax_results)
    step = max(1, math.ceil(g_all.shape[0] / CHUNKS))
    for i in range(0, g_all.shape[0], step):
        g = g_all[i:i + step].float()
        y = y_all[i:i + step].float()
        g_all[i:i + step] = (y * (g - (g * y).sum(-1, keepdim=True)) * float(scale)).to(
            output_grads.dtype)
    return output_grads


def get_batch_per_block(query_seq_len, key_seq_len, batches, attn_heads):
    # csrc/megatron/scaled_masked_softmax.h: warps of min(next power of two, 32) threads,
    # 128 threads a block, two rows a warp up to 128 keys.
    next_power_of_two = 1 << max(0, math.ceil(math.log2(key_seq_len)))
    warp_size = min(next_power_of_two, 32)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    return (128 // warp_size) * batches_per_warp
