"""Conversation batches: a row is one conversation from its start, padded; the loss is the
cross-entropy over the assistant's tokens only; a row computes what its conversation alone does."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import random_model

from quillgpt.data.chat_batches import ChatRows, ChatSampler
from quillgpt.data.chat_data import ASSISTANT, START

BLOCK = 16  # random_model's block_size


def stored(conversations):
    """[(ids, assistant mask)] → the (tokens, flags) arrays prepare writes."""
    ids = np.concatenate([np.asarray(i) for i, _ in conversations])
    flags = np.concatenate([np.where(np.asarray(m, bool), ASSISTANT, 0) for _, m in conversations]).astype(np.uint8)
    flags[np.cumsum([0] + [len(i) for i, _ in conversations[:-1]])] |= START
    return ids, flags


# (ids, which are the assistant's): a short one, one that fills a row exactly, one truncated, one
# whose only reply lies past the window
CONVERSATIONS = [
    ([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1]),
    (list(range(7, 24)), [0] * 10 + [1] * 7),  # 17 = block + 1 tokens
    (list(range(3, 30)), [0] * 5 + [1] * 4 + [0] * 8 + [1] * 10),  # 27 tokens: truncated
    (list(range(30, 10, -1)), [0] * 18 + [1] * 2),  # its reply starts at token 18: outside the window
]


def test_a_row_is_one_conversation_from_its_start_padded_with_ignored_targets():
    rows = ChatRows(*stored(CONVERSATIONS), BLOCK)
    assert len(rows) == 3 and rows.truncated == 2 and rows.untrained == 1  # the 4th is not trained
    x, y = rows.batch(np.array([0, 1, 2]))
    assert x.shape == y.shape == (3, BLOCK) and x.dtype == y.dtype == torch.int64
    assert x[0].tolist() == [1, 2, 3, 4, 5, 6] + [0] * 10 and y[0].tolist() == [-1, -1, 4, 5, 6] + [-1] * 11
    assert x[1].tolist() == list(range(7, 23)) and y[1].tolist() == [-1] * 9 + list(range(17, 24))
    assert x[2].tolist() == list(range(3, 19)) and y[2].tolist() == [-1] * 4 + [8, 9, 10, 11] + [-1] * 8
    assert "2 train conversation(s) are longer than model.block_size + 1 = 17" in rows.describe()
    assert rows.fill == pytest.approx((6 + 17 + 17) / 3 / 17)


def test_the_loss_is_the_cross_entropy_over_the_assistants_tokens_by_hand():
    model = random_model("rope")
    rows = ChatRows(*stored(CONVERSATIONS), BLOCK)
    x, y = rows.batch(np.array([0, 1, 2]))
    _, loss = model(x, y)
    terms = []
    for (ids, mine), n in zip(CONVERSATIONS, (6, 17, 17)):  # each conversation alone, unpadded
        logits, _ = model(torch.tensor([ids[: n - 1]]), all_logits=True)
        for t in range(1, n):
            if mine[t]:
                terms.append(-F.log_softmax(logits[0, t - 1], -1)[ids[t]])
    torch.testing.assert_close(loss, torch.stack(terms).mean(), atol=1e-6, rtol=1e-6)


def test_no_row_attends_across_conversations_or_into_its_padding():
    model = random_model("mha-learned")
    ids, flags = stored(CONVERSATIONS)
    rows = ChatRows(ids, flags, BLOCK)
    x, _ = rows.batch(np.array([0, 1, 0]))
    batched, _ = model(x, all_logits=True)
    for r, (conv, n) in enumerate([(CONVERSATIONS[0][0], 5), (CONVERSATIONS[1][0], 16), (CONVERSATIONS[0][0], 5)]):
        alone, _ = model(torch.tensor([conv[:n]]), all_logits=True)
        torch.testing.assert_close(batched[r, :n], alone[0], atol=1e-5, rtol=1e-5)


def test_the_sampler_draws_seeded_conversations_and_resumes():
    rows = ChatRows(*stored(CONVERSATIONS), BLOCK)
    a, b = ChatSampler(rows, 4, seed=3), ChatSampler(rows, 4, seed=3)
    first = a.next()
    state = a.state_dict()
    assert all(torch.equal(u, v) for u, v in zip(first, b.next()))
    ahead = a.next()
    b.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(ahead, b.next()))
    assert ChatRows(*stored(CONVERSATIONS), BLOCK).fixed(100).tolist() == [0, 1, 2]


def test_a_batch_is_as_long_as_its_longest_row():
    rows = ChatRows(*stored(CONVERSATIONS), BLOCK)
    x, y = rows.batch(np.array([0, 0]))
    assert x.shape == y.shape == (2, 5)  # conversation 0: 6 tokens, not block_size
    assert rows.longest == BLOCK and rows.real_tokens(np.array([0, 1])) == 5 + 16


def test_padded_batches_give_one_conversation_at_a_times_loss_and_gradients():
    """The step's loss (mean over every assistant token of the batch, the head on scored targets only)
    and its gradients = those summed conversation by conversation, each alone and unpadded."""
    model = random_model("rope").train()
    rows = ChatRows(*stored(CONVERSATIONS), BLOCK)
    picks = np.array([0, 2, 1])
    x, y = rows.batch(picks)
    _, loss = model(x, y, scored_only=True)
    loss.backward()
    batched = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total, count = 0.0, int((y != -1).sum())
    for r in picks:
        xr, yr = rows.batch(np.array([r]))
        _, alone = model(xr, yr)
        (alone * (yr != -1).sum() / count).backward()
        total += alone.item() * int((yr != -1).sum()) / count
    assert loss.item() == pytest.approx(total, abs=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(batched[n], p.grad, atol=1e-6, rtol=1e-5)


def test_a_token_budget_groups_similar_lengths_and_covers_each_epoch_once():
    lengths = [3, 40, 5, 41, 4, 39, 6, 42, 3, 38]
    conversations = [(list(range(1, n + 1)), [0] * (n - 2) + [1, 1]) for n in lengths]
    rows = ChatRows(*stored(conversations), 64)
    sampler = ChatSampler(rows, 8, seed=1, batch_tokens=90)
    seen = []
    for _ in range(sampler.batches_per_epoch()):
        x, _ = sampler.next()
        seen.append(x)
        assert x.numel() <= 90 or x.shape[0] == 1
    assert sum(x.shape[0] for x in seen) == len(lengths)
    assert max(x.shape[1] for x in seen if x.shape[1] < 10) < 10  # the short ones are batched together, not with the long
    assert sampler.real == sum(n - 1 for n in lengths)
    state = sampler.state_dict()
    ahead = [sampler.next() for _ in range(3)]  # into the next epoch
    again = ChatSampler(rows, 8, seed=1, batch_tokens=90)
    again.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ahead, [again.next() for _ in range(3)]))
