"""lm-evaluation-harness tasks on a quill model: `quill eval --tasks` through lm-eval's own evaluator.

`QuillLM` is lm-eval's `TemplateLM` over a loaded run, registered as model "quill". It does what
lm-eval's Hugging Face backend (lm_eval/models/huggingface.py) does, so that ids and results agree:

* tokens: `tok_encode` puts the tokenizer's BOS before a text unless the text starts with the
  prefix token's text (as AutoTokenizer's add_special_tokens does); the prefix token (the context of
  an empty context, the first token of a rolling window) is BOS, else end-of-text. TemplateLM
  splits context and continuation as the HF backend does (trailing spaces move to the
  continuation; the continuation is the whole text's ids after the context's).
* loglikelihood: requests sorted by context length, longest first, one context's requests
  together, in batches of `batch_size` (lm-eval's Collator; one-token continuations of one context
  share a forward, and a context shared in a batch runs once), each input cropped on the
  left to block_size + 1 tokens and its last dropped, right-padded; log-softmax over the
  continuation's positions only (the head runs on those alone: most of a multiple-choice
  request's positions are context). Exact match: every continuation token is the argmax.
* loglikelihood_rolling: lm-eval's disjoint rolling windows of block_size tokens (context 1),
  scored as loglikelihood requests: the windows `quill eval --stride block_size` scores, after
  the prefix token.
* generate_until: greedy (or sampled) through quill's engine, `batch_size` rows decoding together
  as rows join and leave (continuous batching), each row stopping at its first stop string or
  stop token; the context cropped on the left to block_size - max_gen_toks; the text decoded
  without special tokens and cut at the stop strings, as lm-eval's postprocessing does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from quillgpt.errors import QuillError

EVAL_INSTALL = 'pip install -e ".[eval]"'


# Standard errors as lm-eval's own CLI reports them (±, not N/A): a mean-type metric (acc) has a
# closed form and takes no draws; the metrics lm-eval bootstraps (perplexity, f1, bleu) take this
# many resamples (its CLI's 100,000 are minutes on two cores for a figure's second digit).
BOOTSTRAP_ITERS = 1000


def _lm_eval() -> Any:
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401
    except ImportError:
        raise QuillError(f"quill eval --tasks runs EleutherAI's lm-evaluation-harness: install the eval extra, {EVAL_INSTALL}") from None
    return lm_eval


lm_eval = _lm_eval()
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from quillgpt.data.chat_template import render, template_messages, transcript  # noqa: E402
from quillgpt.evaluate.task_checks import check_limits, check_task_code, check_tasks, sandboxed_templates  # noqa: E402
from quillgpt.files import atomic_write_text, check_output_file  # noqa: E402
from quillgpt.inference.driver import TextBatch, TextStream  # noqa: E402
from quillgpt.inference.engine import Engine  # noqa: E402
from quillgpt.model.gpt import evaluating  # noqa: E402
from quillgpt.sampling_params import SamplingParams  # noqa: E402

MAX_GEN_TOKS = 256  # lm-eval's default for a generate_until request without max_gen_toks (as its HF backend)


@register_model("quill")
class QuillLM(TemplateLM):
    """A quill model (a LoadedRun's model and tokenizer) as lm-eval's language model."""

    def __init__(self, model: Any = None, tokenizer: Any = None, batch_size: int = 1, ckpt: str | None = None, **load: Any) -> None:
        super().__init__()
        if model is None:  # lm_eval --model quill --model_args ckpt=RUN[,which=..,quantize=int8]
            from quillgpt.runs import load_run

            if ckpt is None:
                raise QuillError("the quill model needs ckpt=RUN in --model_args")
            run = load_run(ckpt, **load)
            model, tokenizer = run.model, run.tokenizer
        batch_size = int(batch_size)
        if batch_size < 1:
            raise QuillError(f"--batch-size must be at least 1, got {batch_size}")
        if model.variant.bidirectional_prefix:
            raise QuillError("lm-eval tasks score causal models; a prefix-LM (model.attention=prefix) is not supported")
        self.model, self.quill_tokenizer, self._batch_size = model, tokenizer, batch_size
        self.max_length = model.config.block_size
        self._device = model.device
        self.tokenizer = tokenizer  # lm-eval reads tokenizer.chat_template

    # --- tokens ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        tok = self.quill_tokenizer
        return tok.eot_id if tok.eot_id is not None else self.prefix_token_id

    @property
    def prefix_token_id(self) -> int:
        """BOS (an HF tokenizer's bos_token, as lm-eval's HF backend takes it), else end-of-text."""
        tok = self.quill_tokenizer
        bos = getattr(tok, "bos_token", None)
        if bos is not None and getattr(tok, "tk", None) is not None and tok.tk.token_to_id(bos) is not None:
            return tok.tk.token_to_id(bos)
        if tok.document_start is not None:
            return tok.document_start
        return tok.encode("\n")[0] if not tok.unknown_chars("\n") else 0

    @property
    def tokenizer_name(self) -> str:
        return self.quill_tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **_: Any) -> list[int]:
        tok = self.quill_tokenizer
        unknown = tok.unknown_chars(string)
        if unknown:
            raise QuillError(f"the task's text has characters the model's {tok.name} vocabulary cannot encode: {''.join(unknown)[:40]!r}")
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(tok.decode([self.prefix_token_id]))
        ids = ([tok.bos_id] if add_special_tokens and tok.bos_id is not None else []) + tok.encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        tok = self.quill_tokenizer
        if getattr(tok, "tk", None) is not None:  # an HF tokenizer: as transformers decodes
            return tok.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return tok.decode(ids)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not chat_template:
            return None
        return self.quill_tokenizer.chat_template or "quill transcript"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's own template (as transformers renders it), or quill's transcript."""
        tok = self.quill_tokenizer
        if tok.chat_template is None:
            return transcript(chat_history, add_generation_prompt)
        bos, eos = getattr(tok, "bos_token", None), getattr(tok, "eos_token", None)
        return render(tok.chat_template, template_messages(chat_history), add_generation_prompt, bos, eos)

    # --- scoring --------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **_: Any) -> list[tuple[float, bool]]:
        collator = Collator(
            requests,
            sort_fn=lambda req: (-len(req[1]), tuple(req[1]), -len(req[2]), tuple(req[2])),  # longest first, a context's requests together
            group_by="contexts",
            group_fn=lambda req: req[-2] + req[-1][:-1],
        )
        results = []
        with evaluating(self.model), torch.inference_mode():
            for chunk in collator.get_batched(n=self._batch_size):
                for (request, context, conts), (cont_logprobs, greedy) in zip(chunk, self._score_chunk(chunk)):
                    for key, cont, logp in collator.get_cache(req_str=request, cxt_toks=context, cont_toks=conts, logits=cont_logprobs):
                        tail = logp[0, -len(cont) :]  # (n, V): one-token continuations of one context share it
                        target = torch.tensor(cont, device=tail.device)
                        answer = (float(tail.gather(1, target[:, None]).sum()), bool((greedy[-len(cont) :] == target).all()))
                        results.append(answer)
                        if key is not None:
                            self.cache_hook.add_partial("loglikelihood", key, answer)
        return collator.get_original(results)

    def _score_chunk(self, chunk: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batch: per request, the (1, n, V) log-softmax at its n continuation positions and
        their argmax tokens."""
        inputs, conts = [], []
        for _, context, cont in chunk:
            if not context or not cont or len(cont) > self.max_length:
                raise QuillError(f"a request's continuation has {len(cont)} tokens; it needs 1 to block_size ({self.max_length})")
            inputs.append((context + cont)[-(self.max_length + 1) :][:-1])
            conts.append(len(cont))
        prefixes = [tuple(ids[: len(ids) - n]) for ids, n in zip(inputs, conts)]
        fits = all(len(p) + max(conts) <= self.max_length for p in prefixes)  # the padding's positions too
        shared = len(set(prefixes)) < len(prefixes) and all(prefixes) and fits and self.model.variant.static_cache
        logits = self._shared_logits(inputs, conts, prefixes) if shared else self._plain_logits(inputs, conts)
        out = []
        for lg in logits:
            logp = F.log_softmax(lg.to(torch.promote_types(lg.dtype, torch.float32)), dim=-1)  # (n, V)
            out.append((logp[None], logp.argmax(-1)))
        return out

    def _plain_logits(self, inputs: list[list[int]], conts: list[int]) -> list[torch.Tensor]:
        """Each request's whole input, right-padded (causal: padding changes nothing before it)."""
        width = max(map(len, inputs))
        idx = torch.zeros(len(inputs), width, dtype=torch.long)
        for i, ids in enumerate(inputs):
            idx[i, : len(ids)] = torch.tensor(ids)
        hidden, _ = self.model._hidden(idx.to(self._device))  # (B, T, C): the head only where scored
        return [self.model.head(hidden[i, len(ids) - n : len(ids)]) for i, (ids, n) in enumerate(zip(inputs, conts))]

    def _shared_logits(self, inputs: list[list[int]], conts: list[int], prefixes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Requests that share a context (a multiple-choice question's choices) run it once: each
        distinct prefix (the tokens before the scored ones) into a KV cache row, left-padded at
        negative positions (masked), then each request's scored tokens over a copy of its row."""
        unique = list(dict.fromkeys(prefixes))
        width, most = max(map(len, unique)), max(conts)
        dev = self._device
        cache = self.model.make_cache(len(unique), width + most)
        idx = torch.zeros(len(unique), width, dtype=torch.long)
        pos = torch.arange(width)[None].repeat(len(unique), 1)
        for u, p in enumerate(unique):
            idx[u, width - len(p) :] = torch.tensor(p)
            pos[u] -= width - len(p)  # the real tokens at 0..len-1, the padding before them negative
        self.model(idx.to(dev), pos=pos.to(dev), cache=cache)
        rows = torch.tensor([unique.index(p) for p in prefixes], device=dev)
        mine = self.model.make_cache(len(inputs), width + most)
        mine.k, mine.v, mine.pos = [k[rows] for k in cache.k], [v[rows] for v in cache.v], cache.pos[rows]
        idx = torch.zeros(len(inputs), most, dtype=torch.long)
        pos = torch.zeros(len(inputs), most, dtype=torch.long)
        for i, (ids, n, p) in enumerate(zip(inputs, conts, prefixes)):
            idx[i, :n] = torch.tensor(ids[len(p) :])
            pos[i] = torch.arange(len(p), len(p) + most)  # right padding after: causal, unseen by the real tokens
        logits, _ = self.model(idx.to(dev), pos=pos.to(dev), cache=mine, all_logits=True)  # (B, most, V)
        return [logits[i, :n] for i, n in enumerate(conts)]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (text,) in [req.args for req in requests]:
            rolling = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)
            mine = [(None, *make_disjoint_window(w)) for w in rolling]
            windows += mine
            counts.append(len(mine))
        scores = [s for s, _ in self._loglikelihood_tokens(windows)] if windows else []
        totals, at = [], 0
        for req, n in zip(requests, counts):
            totals.append(sum(scores[at : at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, totals[-1])
        return totals

    # --- generation -----------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        collator = Collator(
            [req.args for req in requests],
            sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
            group_by="gen_kwargs",
            group_fn=lambda req: req[1],
        )
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        for group in collator.get_batched(n=0):  # every request of one set of gen_kwargs
            contexts, kwargs = [c for c, _ in group], normalize_gen_kwargs(group[0][1], MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            texts = self._generate(contexts, until, kwargs)
            for context, text in zip(contexts, texts):
                self.cache_hook.add_partial("generate_until", (context, group[0][1]), text)
            results += texts
        return collator.get_original(results)

    def _generate(self, contexts: list[str], until: list[str], kwargs: dict[str, Any]) -> list[str]:
        """Each context's continuation: `batch_size` engine rows, a new row joining as one ends."""
        max_new = int(kwargs.pop("max_gen_toks"))
        if max_new >= self.max_length:
            raise QuillError(f"a task asks for {max_new} new tokens; the model's block_size is {self.max_length}")
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=float(kwargs.get("top_p") or 1.0), stop=tuple(until))
        prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_new) for c in contexts]
        engine = Engine(self.model, min(self._batch_size, len(prompts)), capacity=max(map(len, prompts)) + max_new)
        batch, tokens = TextBatch(engine), [[] for _ in prompts]
        stop_ids, waiting = self.quill_tokenizer.stop_ids, list(range(len(prompts)))[::-1]
        pieces = []
        while waiting or len(batch):
            while waiting and batch.free() > 0:
                i = waiting.pop()
                pieces.append(batch.join(i, prompts[i], params, stop_ids, TextStream(self.quill_tokenizer, until)))
            if not pieces:
                pieces = batch.step()
            for piece in pieces:
                if piece.error is not None:
                    raise QuillError(f"generation failed: {piece.error}") from piece.error
                if piece.finish != "eot":
                    tokens[piece.key].append(piece.token)
            pieces = []
        return [postprocess_generated_text(self.tok_decode(t), until, None) for t in tokens]


def evaluate_tasks(
    path: str | Path,
    tasks: list[str],
    *,
    which: str = "best",
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 1,
    include_path: str | Path | None = None,
    apply_chat_template: bool = False,
    device: str = "auto",
    dtype: str = "float32",
    quantize: str | None = None,
    log_samples: bool = False,
    trust_task_code: bool = False,
) -> dict[str, Any]:
    """Load a run and score it on lm-eval `tasks` with lm-eval's evaluator: its results dict
    (results, configs, versions, n-shot; with log_samples each request's responses). The tasks
    are checked first (task_checks: code in the task folder refused unless `trust_task_code`,
    each task built and its first document rendered, --limit and --num-fewshot bounded)."""
    from quillgpt.device import resolve_dtype
    from quillgpt.runs import LoadOptions, load_run

    if not tasks:
        raise QuillError("--tasks needs at least one task name, e.g. --tasks hellaswag,arc_easy")
    if batch_size < 1:
        raise QuillError(f"--batch-size must be at least 1, got {batch_size}")
    check_limits(limit, num_fewshot)
    manager = task_manager(tasks, include_path, trust_task_code)
    with sandboxed_templates(trust_task_code):
        check_tasks(manager, [n for t in tasks for n in (manager.match_tasks([t]) if "*" in t else [t])], num_fewshot)
        options = LoadOptions.parse(device=device, dtype=None, quantize=quantize, which=which, rows=batch_size)
        options = dataclasses.replace(options, dtype=resolve_dtype(dtype, options.device))  # auto: what the device runs best
        run = load_run(path, options)
        lm = QuillLM(run.model, run.tokenizer, batch_size=batch_size)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            apply_chat_template=apply_chat_template,
            log_samples=log_samples,
            bootstrap_iters=BOOTSTRAP_ITERS,
        )
    results["config"].update(
        {"model": "quill", "model_args": {"ckpt": str(path), "which": which, "dtype": dtype, "quantize": options.quantize}}
    )
    return results


def task_manager(tasks: list[str], include_path: str | Path | None = None, trust_task_code: bool = False) -> Any:
    """lm-eval's TaskManager that knows `tasks`: the local folder's alone when it has them all
    (indexing lm-eval's many built-in tasks is slow: docs/performance.md), else the built-in ones
    too. A folder whose YAML names Python is refused first, unless `trust_task_code`."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise QuillError(f"--include-path {include_path}: not a directory (a folder of task YAML files)")
        check_task_code(Path(include_path), trust_task_code)
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(t in set(local.all_tasks) for t in tasks):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known and "*" not in t]
    if unknown:
        where = f" (nor in {include_path})" if include_path else "; a local task needs --include-path DIR"
        raise QuillError(f"lm-eval has no task {', '.join(map(repr, unknown))}{where}; `lm_eval ls tasks` lists them")
    return manager


@dataclass
class TaskRuns:
    """`quill eval --tasks`: each run's lm-eval results (evaluate_tasks), in order."""

    runs: list[dict[str, Any]]

    def to_json(self) -> str:
        """lm-eval's results JSON: one run's object, or a list for several."""
        return results_json(self.runs[0] if len(self.runs) == 1 else self.runs)


def evaluate_runs(
    paths: list[str | Path],
    tasks: list[str],
    *,
    output_path: str | Path | None = None,
    announce: Callable[[str], None] | None = None,
    **settings: Any,
) -> TaskRuns:
    """Each run through evaluate_tasks (`settings`: its keywords); `announce` gets each run's table
    as soon as it is scored; output_path: the results JSON written there (checked first: only an
    earlier results file may be replaced)."""
    if output_path is not None:
        check_output_file(output_path, "--output-path", kind="lm-eval-results")
    runs = []
    for path in paths:
        runs.append(evaluate_tasks(path, tasks, **settings))
        if announce is not None:
            quantize = settings.get("quantize") or "none"
            announce(f"{path}{f' ({quantize})' if quantize != 'none' else ''}:\n{format_results(runs[-1])}")
    done = TaskRuns(runs)
    if output_path is not None:
        atomic_write_text(output_path, done.to_json() + "\n")
    return done


def format_results(results: dict[str, Any]) -> str:
    """lm-eval's own table of the results (and of the groups, if any)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def results_json(results: dict[str, Any]) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, default=handle_non_serializable, ensure_ascii=False, indent=2)
