"""Every batch sampler draws from one seeded generator whose state resumes the stream exactly
(data.batches.SeededSampler), and fixed windows cover a split evenly."""

import numpy as np
import pytest
import torch

from quillgpt.config import ModelConfig
from quillgpt.data.batches import BatchSampler, SeededSampler, fixed_windows
from quillgpt.data.chat_batches import ChatSampler
from quillgpt.data.prefix_batches import PrefixLengths, PrefixSampler


def samplers():
    tokens = np.arange(500, dtype=np.uint16)
    windows = BatchSampler(tokens, block_size=8, batch_size=3, seed=7)
    prefix = PrefixSampler(BatchSampler(tokens, 8, 3, seed=7), PrefixLengths(ModelConfig(block_size=8, attention="prefix"), seed=3))
    return {"windows": windows, "prefix": prefix}


@pytest.mark.parametrize("name", ["windows", "prefix"])
def test_a_resumed_sampler_draws_what_the_uninterrupted_one_drew(name):
    straight, cut = samplers()[name], samplers()[name]
    want = [straight.next() for _ in range(5)]
    for _ in range(2):
        cut.next()
    state = cut.state_dict()
    resumed = samplers()[name]
    resumed.load_state_dict(state)
    got = want[:2] + [resumed.next() for _ in range(3)]
    assert all(all(torch.equal(a, b) for a, b in zip(w, g)) for w, g in zip(want, got))


def test_samplers_share_one_state_rule():
    assert isinstance(samplers()["windows"], SeededSampler)
    assert issubclass(PrefixLengths, SeededSampler) and issubclass(ChatSampler, SeededSampler)


def test_fixed_windows_span_the_split_and_stay_inside_it():
    starts = fixed_windows(np.arange(1000), block_size=16, n=5)
    assert starts[0] == 0 and starts[-1] == 1000 - 16 - 1 and (np.diff(starts) > 0).all()
