"""Run every int8 kernel on tiny tied models of the given shapes (a child process of
test_int8_shapes.py, so a kernel that crashes on a shape fails that test, not the suite).

    python int8_shapes_worker.py '[[n_embd, n_head], ...]'

For each shape, kernel and int8 scheme (per 32 weights, per channel): the quantized model's
logits at 1, 3 and 8 positions against the same model with its linears replaced by their
dequantized weights. Prints one JSON line per shape:
{"shape": [...], "err": {kernel: relative error}}.
"""

import copy
import json
import sys

import torch

from quillgpt.config import ModelConfig
from quillgpt.model.gpt import GPT
from quillgpt.quant import dequantize, quantize
from quillgpt.quant.int8_kernels import KERNELS


def main() -> None:
    torch.set_num_threads(1)
    for n_embd, n_head in json.loads(sys.argv[1]):
        torch.manual_seed(n_embd * 31 + n_head)
        cfg = ModelConfig(vocab_size=29, block_size=16, n_layer=1, n_head=n_head, n_embd=n_embd, tie_embeddings=True)
        base = GPT(cfg).eval()
        err = {}
        for kernel in KERNELS:
            for scheme in ("int8", "int8-channel"):  # per 32 where the width holds groups, and per row
                model = quantize(copy.deepcopy(base), scheme, kernel=kernel)
                ref = dequantize(copy.deepcopy(model))
                for t in (1, 3, 8):
                    ids = torch.randint(0, 29, (2, t))
                    with torch.no_grad():
                        got, want = model(ids, all_logits=True)[0], ref(ids, all_logits=True)[0]
                    e = float((got - want).norm() / want.norm().clamp(min=1e-12))
                    err[kernel] = max(err.get(kernel, 0.0), e)
        measured = quantize(copy.deepcopy(base), "int8")  # the probe itself times every candidate on this shape
        with torch.no_grad():
            measured(torch.randint(0, 29, (1, 5)))
        print(json.dumps({"shape": [n_embd, n_head], "err": err}), flush=True)


if __name__ == "__main__":
    main()
