"""tools/gpu/megatron_standins without a GPU: the fused-softmax stand-ins compute what
Megatron's masked softmax computes (PyTorch's softmax of the scaled, masked scores; its
backward), chunk for chunk across chunk edges."""

from __future__ import annotations

import sys
import unittest
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu" /
                       "megatron_standins"))
import _softmax_impl  # noqa: E402
import scaled_masked_softmax_cuda  # noqa: E402
import scaled_softmax_cuda  # noqa: E402
import scaled_upper_triang_masked_softmax_cuda  # noqa: E402


class SoftmaxStandInTest(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        # Four chunks over 6 matrices: chunks of two, the last one short.
        self.saved = _softmax_impl.CHUNKS
        _softmax_impl.CHUNKS = 4

    def tearDown(self):
        _softmax_impl.CHUNKS = self.saved

    def test_causal(self):
        x = torch.randn(6, 16, 16)
        causal = torch.ones(16, 16, dtype=torch.bool).triu(1)
        expected = torch.softmax((x * 0.5).masked_fill(causal, -10000.0), -1)
        got = scaled_upper_triang_masked_softmax_cuda.forward(x, 0.5)
        self.assertTrue(torch.allclose(got, expected, atol=1e-6))

    def test_padding_mask_per_batch(self):
        x = torch.randn(2, 3, 10, 16)
        mask = torch.rand(2, 1, 10, 16) > 0.7
        expected = torch.softmax((x * 0.5).masked_fill(mask, -10000.0), -1)
        got = scaled_masked_softmax_cuda.forward(x, mask, 0.5)
        self.assertTrue(torch.allclose(got, expected, atol=1e-6))

    def test_unmasked_and_backward_in_place(self):
        x = torch.randn(2, 3, 10, 16)
        self.assertTrue(torch.allclose(scaled_softmax_cuda.forward(x, 0.5),
                                       torch.softmax(x * 0.5, -1), atol=1e-6))
        y = torch.softmax(x, -1)
        grad = torch.randn_like(y)
        expected = y * (grad - (grad * y).sum(-1, keepdim=True)) * 0.5
        out = grad.clone()
        self.assertIs(_softmax_impl.backward(out, y, 0.5), out)
        self.assertTrue(torch.allclose(out, expected, atol=1e-6))


if __name__ == "__main__":
    unittest.main()
