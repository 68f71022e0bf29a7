"""int5 (quant/int5.py): weights that were llama.cpp's Q5_0 come back exactly when quantized from
float, as they do when a GGUF file's blocks are imported."""

import torch

from quillgpt.quant import int5


def test_q5_0_weights_come_back_exactly():
    """(q - 16)·d with fp16 d of either sign and the weight of largest magnitude at q = 0, as
    llama.cpp's Q5_0 makes them (Gemma 3 270M's q, k, gate and up): int5's symmetric form is
    Q5_0's, so `--quantize int5` of a dequantized Q5_0 model keeps its weights; a symmetric form
    over ±15 steps of max|w| / 15 moved nearly every group."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 32, (32, 128), generator=g).float()
    q[:, ::32] = 0  # the largest magnitude in each group, as Q5_0 makes it
    d = (torch.randn(32, 4, generator=g) * 0.01).half().float().repeat_interleave(32, dim=1)
    w = (q - 16) * d
    packed = int5.pack(w, 32)
    assert torch.equal(int5.INT5.unpack(packed), w)
    assert packed["codes"].min() == -16 and packed["codes"].max() <= 15
    assert torch.equal(int5.codes_of(int5.store(packed)), packed["codes"])  # and they store in 5 bits
