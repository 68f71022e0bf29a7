"""group_codes: the per-group parts int8 and int4 share (their layouts are tested in test_quant
and test_int4)."""

import torch

from quillgpt.quant import group_codes


def test_grouped_views_each_row_in_groups_with_their_range():
    w = torch.arange(12.0).view(2, 6)
    wg, low, high = group_codes.grouped(w, 3)
    assert wg.shape == (2, 2, 3) and torch.equal(low, torch.tensor([[0.0, 3.0], [6.0, 9.0]])) and torch.equal(high, low + 2)


def test_codes_round_against_the_stored_scale_and_clamp_and_a_zero_scale_gives_code_0():
    wg = torch.tensor([[[0.0, 0.26, 0.74, 5.0]], [[1.5, 1.5, 1.5, 1.5]]])
    s, o = torch.tensor([[0.25], [0.0]]), torch.tensor([[0.0], [1.5]])
    assert torch.equal(group_codes.codes(wg, s, o, 0, 15), torch.tensor([[[0.0, 1.0, 3.0, 15.0]], [[0.0, 0.0, 0.0, 0.0]]]))
    assert torch.equal(group_codes.codes(wg[:1], -s[:1], o[:1], -8, 7), torch.tensor([[[0.0, -1.0, -3.0, -8.0]]]))  # negative s


def test_better_takes_the_form_with_less_error_per_group_the_first_on_ties_and_never_a_non_finite_one():
    wg = torch.tensor([[[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]])  # (1 row, 4 groups, 2)
    one = torch.ones(1, 4)
    exact = (wg.clone(), one, 0 * one)  # q·1 + 0: every group exact
    shifted = (wg - 1, one, one)  # (q - 1)·1 + 1: exact too (a tie)
    q, s, o = group_codes.better(wg, exact, shifted)
    assert torch.equal(o, 0 * one)  # ties: the first
    off = (wg.clone(), one, torch.tensor([[0.5, 0.0, 0.5, 0.0]]))  # groups 0 and 2 off by 0.5
    q, s, o = group_codes.better(wg, off, shifted)
    assert torch.equal(o, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))  # the second where it is better
    inf = (wg.clone(), torch.tensor([[float("inf"), 1.0, 1.0, 1.0]]), 0 * one)  # group 0's scale not finite
    q, s, o = group_codes.better(wg, inf, off)
    assert s[0, 0] == 1.0 and o[0, 0] == 0.5  # an inexact finite form beats a non-finite one
    q, s, o = group_codes.better(wg, off, inf)
    assert s[0, 0] == 1.0 and o[0, 0] == 0.5
