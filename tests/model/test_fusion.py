"""fusion.stored: the same values as its input, eager and compiled, whatever the input's layout
(a transposed view's strides must not be applied to a buffer inductor lays out afresh)."""

from __future__ import annotations

import pytest
import torch

from quillgpt.model.fusion import stored


def producer_then_consumer(x: torch.Tensor, dynamic_rows: torch.Tensor) -> torch.Tensor:
    """As attention's query: a slice of a wider buffer (q of q/k/v), viewed per head, transposed."""
    R = dynamic_rows.shape[0]
    qkv = x * 2  # (R, 3·48)
    q = qkv[:, :48].view(R, 1, 6, 8).transpose(1, 2)  # (R, H, 1, hd): rows 144 apart in qkv
    q = stored(q.reshape(R, 3, 2, 1, 8))
    return (q * q.sum(-1, keepdim=True)).sum(2)


@pytest.mark.parametrize("dynamic", [False, True])
def test_stored_keeps_values_eager_and_compiled(dynamic):
    torch.manual_seed(0)
    compiled = torch.compile(producer_then_consumer, fullgraph=True, dynamic=dynamic)
    for rows in (1, 4):
        x = torch.randn(rows, 144)
        want = producer_then_consumer(x, x)
        torch.testing.assert_close(compiled(x, x), want)
    x = torch.randn(4, 144)

    assert torch.equal(stored(x), x) and stored(x).data_ptr() == x.data_ptr()  # eager: a free view
    torch._dynamo.reset()
