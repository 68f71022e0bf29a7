"""An embedding table kept quantized: a GGUF file's token_embd stays in its own type (a tied one is
the head's layer itself), and a lookup dequantizes only the rows it reads. An 8B's table in fp32
would be a sixth of its run."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quillgpt.quant.scheme import QuantLinear


class QuantEmbedding(nn.Module):
    """nn.Embedding's call, (…) ids → (…, C) in `dtype`, reading the rows of a quantized (V, C) table."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype = dtype

    def forward(self, idx: Tensor) -> Tensor:
        return self.table.rows(idx.reshape(-1)).to(self.dtype).view(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, quantized"
