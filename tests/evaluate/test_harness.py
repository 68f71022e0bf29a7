"""`quill eval --tasks` (lm-eval's evaluator over quill's model class) against lm-eval's own
Hugging Face backend on the same weights: an imported random SmolLM2-like model, and small local
tasks (multiple choice, generate_until, rolling loglikelihood) written here as YAML + jsonl."""

import json
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

from harness_support import MC, TASKS, responses, write_tasks  # noqa: E402
from hf_support import CORPUS, make_hf_model  # noqa: E402

from quillgpt.cli import main  # noqa: E402
from quillgpt.evaluate.harness import QuillLM, evaluate_runs, evaluate_tasks  # noqa: E402
from quillgpt.evaluate.scores import evaluate_tokens  # noqa: E402
from quillgpt.interop.convert import import_hf  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF directory with a short context, so rolling windows overlap; quill run; task folder)."""
    root = tmp_path_factory.mktemp("harness")
    hf_dir = make_hf_model(root / "hf", "smollm2")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))  # RoPE: the weights do not change
    import_hf(hf_dir, root / "run")
    return hf_dir, root / "run", write_tasks(root / "tasks")


@pytest.fixture(scope="module")
def both(setup):
    hf_dir, run_dir, tasks = setup
    from lm_eval.tasks import TaskManager

    ours = evaluate_tasks(run_dir, TASKS, which="latest", batch_size=3, include_path=tasks, log_samples=True)
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},dtype=float32",
        tasks=TASKS,
        batch_size=3,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        device="cpu",
        bootstrap_iters=0,
    )
    return ours, theirs


def test_tasks_give_lm_eval_hf_backends_results_request_by_request(both):
    ours, theirs = both
    mine, ref = responses(ours), responses(theirs)
    for task in ("tiny_mc", "tiny_roll"):
        got = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in mine[task]], dtype=float)
        want = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in ref[task]], dtype=float)
        assert len(got) == len(want) > 0
        assert np.abs(got - want).max() <= 1e-4, task
    assert [r[0][1] for r in mine["tiny_mc"]] == [r[0][1] for r in ref["tiny_mc"]]  # is-greedy
    assert mine["tiny_gen"] == ref["tiny_gen"] and any(r[0] for r in mine["tiny_gen"])
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]
    assert ours["results"]["tiny_gen"]["exact_match,none"] == theirs["results"]["tiny_gen"]["exact_match,none"]
    roll = ours["results"]["tiny_roll"]["bits_per_byte,none"]
    assert roll == pytest.approx(theirs["results"]["tiny_roll"]["bits_per_byte,none"], rel=1e-5)


def test_rolling_loglikelihood_is_quill_evals_loss_over_the_same_windows(setup):
    """lm-eval's disjoint windows of block_size = quill eval's sliding pass at stride block_size
    over the prefix token and the text's ids: the same summed nats."""
    _, run_dir, _ = setup
    run = load_run(run_dir, which="latest")
    lm = QuillLM(run.model, run.tokenizer, batch_size=2)
    text = " ".join(CORPUS)
    request = type("Request", (), {"args": (text,)})()
    (rolling,) = lm.loglikelihood_rolling([request])
    ids = [lm.prefix_token_id] + lm.tok_encode(text)
    assert len(ids) > 3 * run.model.config.block_size  # several windows, the last one partial
    ref = evaluate_tokens(run.model, np.array(ids), batch_size=4)
    assert -rolling == pytest.approx(ref.nats, rel=1e-5)


def test_quill_eval_tasks_prints_the_table_and_writes_the_results(setup, tmp_path, capsys):
    _, run_dir, tasks = setup
    out = tmp_path / "results.json"
    args = ["eval", "--ckpt", str(run_dir), "--which", "latest", "--tasks", "tiny_mc", "--include-path", str(tasks)]
    with pytest.raises(SystemExit) as e:
        main([*args, "--limit", "4", "--batch-size", "8", "--output-path", str(out)])
    assert e.value.code == 0
    table = capsys.readouterr().out
    assert "tiny_mc" in table and "acc_norm" in table
    saved = json.loads(out.read_text())
    acc, stderr = saved["results"]["tiny_mc"]["acc,none"], saved["results"]["tiny_mc"]["acc_stderr,none"]
    assert acc in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert stderr == pytest.approx((acc * (1 - acc) / 3) ** 0.5)  # the sample standard error of 4 answers: lm-eval's ±, not N/A
    assert "N/A" not in table
    assert saved["config"]["model"] == "quill"
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    with pytest.raises(SystemExit) as e:  # a file that is not lm-eval's results is not replaced
        main([*args, "--limit", "1", "--output-path", str(other)])
    assert e.value.code == 2 and "--output-path" in capsys.readouterr().err and other.read_text() == '{"mine": 1}'


def test_evaluate_runs_announces_each_run_and_writes_them_all(setup, tmp_path):
    _, run_dir, tasks = setup
    said, out = [], tmp_path / "results.json"
    done = evaluate_runs(
        [run_dir, run_dir], ["tiny_mc"], output_path=out, announce=said.append, which="latest", limit=2, include_path=tasks
    )
    assert len(done.runs) == 2 and out.read_text() == done.to_json() + "\n"
    assert [line.split("\n")[0] for line in said] == [f"{run_dir}:"] * 2 and all("acc_norm" in line for line in said)
    assert [r["config"]["model_args"]["quantize"] for r in json.loads(out.read_text())] == [None, None]


def test_without_lm_eval_tasks_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    monkeypatch.delitem(sys.modules, "quillgpt.evaluate.harness")
    with pytest.raises(SystemExit) as e:
        main(["eval", "--ckpt", str(tmp_path), "--tasks", "hellaswag"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and '.[eval]"' in err and len(err.splitlines()) == 1


def test_quill_eval_tasks_refuses_in_one_line(setup, tmp_path, capsys):
    _, run_dir, tasks = setup
    for extra, expected in (
        (["--tasks", "tiny_mc", "--include-path", str(tmp_path / "missing")], "not a directory"),
        (["--tasks", "tiny_mc", "--include-path", str(tasks), "--batch-size", "0"], "--batch-size"),
        (["--tasks", "tiny_mc", "--include-path", str(tasks), "--text", str(tmp_path)], "--tasks"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["eval", "--ckpt", str(run_dir), "--which", "latest", *extra])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, err


def test_bos_tokenizers_encode_as_autotokenizer(tmp_path):
    """A Llama 3-like tokenizer (BOS from its post-processor): tok_encode and the prefix token are
    AutoTokenizer's, with and without the BOS already in the text."""
    import transformers

    hf_dir = make_hf_model(tmp_path / "hf", "llama3")
    import_hf(hf_dir, tmp_path / "run")
    run = load_run(tmp_path / "run", which="latest")
    lm, auto = QuillLM(run.model, run.tokenizer), transformers.AutoTokenizer.from_pretrained(hf_dir)
    for text in (CORPUS[0], "<|begin_of_text|>" + CORPUS[1]):
        assert lm.tok_encode(text) == auto.encode(text, add_special_tokens=not text.startswith(auto.bos_token))
    assert lm.prefix_token_id == auto.bos_token_id
    assert lm.tok_encode(CORPUS[3], add_special_tokens=False) == auto.encode(CORPUS[3], add_special_tokens=False)
    assert torch.equal(torch.tensor(lm.tok_encode(CORPUS[3])[1:]), torch.tensor(lm.tok_encode(CORPUS[3], add_special_tokens=False)))


def test_shared_contexts_score_as_each_request_alone(setup):
    """The fast path (each distinct context once into a KV cache, left-padded, then every choice
    over a copy of its row) = each request's whole input through the plain forward."""
    _, run_dir, _ = setup
    run = load_run(run_dir, which="latest")
    lm = QuillLM(run.model, run.tokenizer, batch_size=8)
    chunk = []
    for context in (CORPUS[0][:30], CORPUS[1][:12]):
        for cont in (" window", " breaks? It is", " O"):
            chunk.append((None, *lm._encode_pair(context, cont)))
    inputs = [(c + k)[:-1] for _, c, k in chunk]
    conts = [len(k) for _, _, k in chunk]
    prefixes = [tuple(ids[: len(ids) - n]) for ids, n in zip(inputs, conts)]
    assert len(set(prefixes)) == 2 and len(set(map(len, prefixes))) == 2  # two contexts, padded to one width
    with torch.no_grad():
        fast, plain = lm._shared_logits(inputs, conts, prefixes), lm._plain_logits(inputs, conts)
    for a, b in zip(fast, plain):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4


def test_a_char_run_scores_each_choice_as_its_own_log_softmax(setup, tmp_path):
    """A quill-trained kind of run (char vocabulary, learned positions): every choice's
    loglikelihood is the summed log-softmax of its characters after the question's."""
    from quillgpt.config import Config, ModelConfig
    from quillgpt.data.tokenizer import CharTokenizer
    from quillgpt.model.gpt import GPT
    from quillgpt.runs import write_run

    _, _, tasks = setup
    tok = CharTokenizer.from_text("".join(CORPUS) + "".join(c for _, cs, _ in MC for c in cs))
    torch.manual_seed(0)
    cfg = Config(model=ModelConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32))
    (tmp_path / "char").mkdir()
    write_run(tmp_path / "char", cfg, tok, GPT(cfg.model).state_dict())
    got = evaluate_tasks(tmp_path / "char", ["tiny_mc"], which="latest", batch_size=5, include_path=tasks, log_samples=True)
    run = load_run(tmp_path / "char", which="latest")
    want = []
    for question, choices, _ in MC:
        for choice in choices:
            ids = tok.encode(question + " " + choice)  # lm-eval's target_delimiter: " "
            with torch.no_grad():
                logp = torch.log_softmax(run.model(torch.tensor([ids]), all_logits=True)[0][0], dim=-1)
            n = len(tok.encode(question))
            want.append(sum(logp[i - 1, ids[i]].item() for i in range(n, len(ids))))
    mine = [r[0][0] for r in responses(got)["tiny_mc"]]
    assert mine == pytest.approx(want, abs=1e-4)


def test_choices_of_a_context_at_the_block_size_score_without_passing_it(setup, tmp_path):
    """Learned positions stop at block_size - 1: choices of different lengths after a context that
    fills the block (cropped on the left) score as each alone, never at a position past it."""
    from quillgpt.config import Config, ModelConfig
    from quillgpt.data.tokenizer import CharTokenizer
    from quillgpt.model.gpt import GPT

    tok = CharTokenizer.from_text("".join(CORPUS))
    torch.manual_seed(0)
    cfg = Config(model=ModelConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16))
    lm = QuillLM(GPT(cfg.model).eval(), tok, batch_size=8)
    context = tok.encode(CORPUS[0][:40])
    chunk = [(None, context, tok.encode(c)) for c in (" a", " b", " def")]  # two share a context: the fast path
    got = lm._score_chunk(chunk)
    for (_, c, k), (logp, _) in zip(chunk, got):
        alone = lm._score_chunk([(None, c, k)])[0][0]
        assert logp.shape == alone.shape and (logp - alone).abs().max() < 1e-5


def hostile_folder(tasks, tmp_path, name, change):
    """A folder with one task: tiny_mc's YAML renamed `name` and changed by `change`, and a utils.py
    that leaves a mark if anything runs it."""
    folder = tmp_path / name
    folder.mkdir()
    text = (tasks / "tiny_mc.yaml").read_text().replace("task: tiny_mc", f"task: {name}")
    (folder / f"{name}.yaml").write_text(change(text))
    (folder / "utils.py").write_text(
        f"import pathlib\n\ndef f(doc):\n    pathlib.Path({str(tmp_path / 'RAN')!r}).touch()\n    return 'x'\n"
    )
    return folder


# name → (how tiny_mc's YAML is damaged, what the one line says)
HOSTILE_TASKS = {
    "no_dataset": (lambda t: t.replace("dataset_path: json\n", ""), "task no_dataset: its YAML has no dataset_path"),
    "no_text": (lambda t: t.replace('doc_to_text: "{{question}}"\n', ""), "task no_text: its YAML has no doc_to_text"),
    "no_split": (lambda t: t.replace("test_split: train\n", ""), "task no_split: its YAML has no test_split"),
    "bad_output": (lambda t: t.replace("output_type: multiple_choice", "output_type: essay"), "output_type 'essay' is not one of"),
    "bad_metric": (lambda t: t.replace("metric: acc_norm", "metric: vibes"), "task bad_metric: unknown metric 'vibes'"),
    "bad_template": (
        lambda t: t.replace('"{{question}}"', '"{{question"'),
        "task bad_template: lm-eval cannot load it (TemplateSyntaxError",
    ),
    "undefined": (lambda t: t.replace('"{{question}}"', '"{{nothing}}"'), "'nothing' is undefined"),
    "escape": (lambda t: t.replace('"{{question}}"', '"{{ question.__class__.__mro__ }}"'), "SecurityError"),
    "no_data": (lambda t: t.replace("mc.jsonl", "none.jsonl"), "task no_data: data file"),
    "endless_data": (lambda t: t.replace(t.split("train: ")[1].split("\n")[0], "/dev/zero"), "data file /dev/zero is a device"),
    "function": (lambda t: t.replace('doc_to_text: "{{question}}"', "doc_to_text: !function utils.f"), "--trust-task-code"),
    "python_tag": (lambda t: t + "x: !!python/name:os.system\n", "runs Python from the task folder"),
}


@pytest.mark.parametrize("name", HOSTILE_TASKS)
def test_a_hostile_or_malformed_task_folder_is_one_line_and_runs_nothing(setup, tmp_path, capsys, name):
    _, run_dir, tasks = setup
    change, expected = HOSTILE_TASKS[name]
    folder = hostile_folder(tasks, tmp_path, name, change)
    with pytest.raises(SystemExit) as e:
        main(["eval", "--ckpt", str(run_dir), "--which", "latest", "--tasks", name, "--include-path", str(folder)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and expected in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "RAN").exists()


def test_a_group_that_includes_itself_is_named(setup, tmp_path, capsys):
    _, run_dir, _ = setup
    folder = tmp_path / "groups"
    folder.mkdir()
    (folder / "a.yaml").write_text("group: loop_a\ntask:\n  - loop_b\n")
    (folder / "b.yaml").write_text("group: loop_b\ntask:\n  - loop_a\n")
    with pytest.raises(SystemExit) as e:
        main(["eval", "--ckpt", str(run_dir), "--which", "latest", "--tasks", "loop_a", "--include-path", str(folder)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "group loop_a includes itself (loop_a → loop_b → loop_a)" in err and len(err.splitlines()) == 1


def test_trusted_task_code_runs(setup, tmp_path):
    _, run_dir, tasks = setup
    folder = hostile_folder(
        tasks, tmp_path, "trusted", lambda t: t.replace('doc_to_text: "{{question}}"', "doc_to_text: !function utils.f")
    )
    got = evaluate_tasks(run_dir, ["trusted"], which="latest", include_path=folder, limit=2, trust_task_code=True)
    assert (tmp_path / "RAN").exists() and "trusted" in got["results"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--limit", "0"], "--limit must be a number of documents"),
        (["--limit", "-1"], "--limit must be"),
        (["--limit", "nan"], "--limit must be"),
        (["--limit", "inf"], "--limit must be"),
        (["--limit", "1e300"], "--limit must be"),
        (["--limit", "2.5"], "--limit must be"),
        (["--num-fewshot", "-1"], "--num-fewshot must be between 0 and 1,024"),
        (["--num-fewshot", "100000"], "--num-fewshot must be between 0 and 1,024"),
        (["--num-fewshot", "9223372036854775808"], "--num-fewshot"),
        (["--num-fewshot", "50"], "--num-fewshot 50: task tiny_mc has only 5 documents"),
        (["--batch-size", "9223372036854775808"], "--batch-size"),
    ],
)
def test_limit_and_fewshot_are_bounded(setup, capsys, flags, expected):
    _, run_dir, tasks = setup
    with pytest.raises(SystemExit) as e:
        main(["eval", "--ckpt", str(run_dir), "--which", "latest", "--tasks", "tiny_mc", "--include-path", str(tasks), *flags])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and expected in err and len(err.splitlines()) == 1, err
