import torch

from _softmax_impl import backward, softmax


def forward(inputs, scale):
    sq, sk = inputs.shape[-2], inputs.shape[-1]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=inputs.device).triu_(1)
    return softmax(inputs, scale, lambda a, b: causal)
