"""The engine's per-row constraint seam and llguidance's grammars over quill's tokenizers: a
constrained row draws only what its constraint allows and ends ("stop") when it is done; a row
without one, beside it, gets exactly its tokens alone and costs no mask work; a constraint that
allows nothing fails its row alone. Grammars compile over the char, BPE (tiktoken) and Hugging
Face tokenizers, and every token they allow keeps the text valid JSON."""

import json

import pytest
import torch
from support import PROMPTS, random_model

from quillgpt.data.tokenizer import CharTokenizer, train_bpe
from quillgpt.inference.engine import Engine, Prompt
from quillgpt.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12)
SEEDED = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, repetition_penalty=1.2, seed=7)


class EvenIds:
    """A toy constraint: even ids only, done after `length` tokens."""

    def __init__(self, length=5):
        self.length, self.seen, self.done = length, [], False

    def allowed(self, vocab_size):
        return torch.arange(vocab_size) % 2 == 0

    def advance(self, token):
        self.seen.append(token)
        self.done = len(self.seen) >= self.length


class Nothing(EvenIds):
    def allowed(self, vocab_size):
        return torch.zeros(vocab_size, dtype=torch.bool)


def run(engine, prompts):
    """Every row to its end: each row's tokens and finish."""
    firsts = engine.add_all(prompts)
    out = {t.row: [t] for t in firsts}
    while engine.active_rows():
        for t in engine.step():
            out[t.row].append(t)
    return [([t.token for t in out[f.row]], out[f.row][-1].finish) for f in firsts]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_row_beside_a_constrained_one_gets_its_tokens_alone(params):
    model = random_model("rope-window-gqa")
    free = Prompt(PROMPTS[1], params)
    (alone,) = run(Engine(model, 1), [free])
    (constrained_alone,) = run(Engine(model, 1), [Prompt(PROMPTS[0], params, constraint=EvenIds())])
    both = run(Engine(model, 2), [Prompt(PROMPTS[0], params, constraint=EvenIds()), free])
    assert both == [constrained_alone, alone]
    tokens, finish = constrained_alone
    assert finish == "stop" and len(tokens) == 5 and all(t % 2 == 0 for t in tokens)
    assert any(t % 2 for t in alone[0])  # the free row was not masked


def test_rows_without_a_constraint_do_no_mask_work(monkeypatch):
    def never(*args):
        raise AssertionError("mask work for rows without a constraint")

    monkeypatch.setattr(Engine, "_constrain", never)
    engine = Engine(random_model(), 2)
    assert all(finish == "length" for _, finish in run(engine, [Prompt(PROMPTS[0], GREEDY), Prompt(PROMPTS[1], SEEDED)]))


def test_a_constraint_that_allows_nothing_fails_its_row_alone():
    model = random_model()
    (alone,) = run(Engine(model, 1), [Prompt(PROMPTS[1], GREEDY)])
    engine = Engine(model, 2)
    firsts = engine.add_all([Prompt(PROMPTS[0], GREEDY, constraint=Nothing()), Prompt(PROMPTS[1], GREEDY)])
    assert firsts[0].finish == "error" and "allows no next token" in str(firsts[0].error)
    rest = [firsts[1].token]
    while engine.active_rows():
        rest += [t.token for t in engine.step()]
    assert rest == alone[0]


# --- llguidance over quill's tokenizers -------------------------------------------------------

TEXT = 'Speak, friend, and enter. {"a": [1, 2.5, true, null], "b": "x"} 0123456789 abcdefghijklmnopqrstuvwxyz ' * 20
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["ab", "cd"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}


def char_tokenizer():
    return CharTokenizer.from_text(TEXT)


def bpe_tokenizer():
    return train_bpe(TEXT, 300)


def hf_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from hf_support import make_hf_model

    from quillgpt.data.hf_tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(make_hf_model(tmp_path / "hf", "qwen2"))


@pytest.mark.parametrize("make", ["char", "bpe", "hf"])
def test_every_token_a_json_grammar_allows_keeps_the_text_valid(make, tmp_path):
    pytest.importorskip("llguidance")
    from quillgpt.inference.constraint import Grammar, json_grammar

    tok = {"char": char_tokenizer, "bpe": bpe_tokenizer, "hf": lambda: hf_tokenizer(tmp_path)}[make]()
    vocab = tok.vocab_size + 3  # a model's vocabulary may be padded past its tokenizer's
    grammar = Grammar.compile(json_grammar(SCHEMA), tok, vocab)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        c, ids = grammar.constraint(), []
        while not c.done:
            allowed = c.allowed(vocab)
            assert not allowed[tok.vocab_size :].any()  # padding ids never
            choices = [i for i in allowed.nonzero().flatten().tolist() if i not in tok.stop_ids]
            ids.append(choices[int(torch.randint(len(choices), (1,), generator=gen))])
            c.advance(ids[-1])
        value = json.loads(tok.decode(ids))
        assert set(value) == {"n", "tag"} and 0 <= value["n"] <= 99 and value["tag"] in ("ab", "cd")


def test_a_vocabulary_that_cannot_write_the_grammar_is_refused():
    pytest.importorskip("llguidance")
    from quillgpt.inference.constraint import Grammar, InvalidGrammar, json_grammar

    tok = CharTokenizer.from_text("no braces here")
    with pytest.raises(InvalidGrammar, match="cannot write"):
        Grammar.compile(json_grammar(None), tok, tok.vocab_size)
