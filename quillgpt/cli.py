"""The `quill` command line: parse arguments, call one library function, print.

Nothing here is needed to use QuillGPT from Python; every command is a thin shell over a
function in the package. A `QuillError` (a user mistake) becomes one line on stderr and exit
code 2; `QUILL_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from quillgpt.config import MAX_INT
from quillgpt.errors import QuillError
from quillgpt.files import check_input, check_output_file
from quillgpt.quant import help_text
from quillgpt.runs import LoadOptions, merge_run
from quillgpt.sampling_params import MAX_PROMPT_BYTES, MAX_PROMPT_CHARS

if TYPE_CHECKING:
    from quillgpt.interop.convert import Converted

# The errors typer raises for bad flags: click's ClickException in older typer, the same class
# from typer's own copy of click (typer._click, no click dependency) in newer typer.
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

app = typer.Typer(
    name="quill",
    help="QuillGPT: prepare data, train, sample, evaluate and look inside small GPTs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

CONFIG_OPT = typer.Option(..., "--config", "-c", help="YAML recipe, e.g. configs/shakespeare_char_cpu.yaml.")
OVERRIDES_ARG = typer.Argument(None, help="Config overrides as section.key=value, e.g. train.max_iters=200 model.n_layer=2.")


# The flags `quill sample` and `quill chat` share (defined once, used by both).
MAX_NEW_OPT = typer.Option(
    None,
    "--max-new-tokens",
    "-n",
    help="Tokens per sample (chat: per reply). This and the sampling flags default to the run's `sample:` config.",
)
TEMPERATURE_OPT = typer.Option(None, "--temperature", help="Randomness; 0 = greedy (always the most likely token).")
TOP_K_OPT = typer.Option(None, "--top-k", help="Sample among the k most likely tokens; 0 = no limit.")
TOP_P_OPT = typer.Option(None, "--top-p", help="Nucleus: the most likely tokens up to this probability mass, in (0, 1].")
MIN_P_OPT = typer.Option(None, "--min-p", help="Drop tokens less likely than min_p x the top token, in [0, 1).")
REPETITION_OPT = typer.Option(None, "--repetition-penalty", help="> 1 makes tokens already in the text less likely; 1 = off.")
SEED_OPT = typer.Option(None, "--seed", help="Same seed, same text.")
# The sampling flags `sample` and `chat` share, each defined once: name → (type, option).
SAMPLING_FLAGS: dict[str, tuple[Any, Any]] = {
    "max_new_tokens": (int | None, MAX_NEW_OPT),
    "temperature": (float | None, TEMPERATURE_OPT),
    "top_k": (int | None, TOP_K_OPT),
    "top_p": (float | None, TOP_P_OPT),
    "min_p": (float | None, MIN_P_OPT),
    "repetition_penalty": (float | None, REPETITION_OPT),
    "seed": (int | None, SEED_OPT),
}
DTYPE_OPT = typer.Option(
    "float32", "--dtype", help="float32, bfloat16 or float16: the weights and the KV cache; bfloat16 reads half the bytes per token."
)
DEVICE_OPT = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps.")
WHICH_OPT = typer.Option("best", "--which", help="Which checkpoint of a run directory: best or latest.")
COMPILE_OPT = typer.Option(
    False,
    "--compile/--no-compile",
    help="torch.compile the decode step (quill serve: before it listens): about twice the tokens/s with --quantize int8, int8-channel or int4 on a CPU; compiling takes 30-60 s the first time on a machine, seconds from inductor's cache after that.",
)
# --quantize: the schemes, described once; each command's option says first what it does with them.
QUANT_HELP = help_text()  # each scheme of the registry (quillgpt.quant.SCHEMES) in a phrase, then none


def count_option(default: int | None, *names: str, help: str) -> Any:  # noqa: A002 (typer's own name)
    """An integer flag, bounded where it is parsed as every integer of a config is (±2**62,
    config.MAX_INT): 9223372036854775808 is one line here, not an overflow deep inside. The
    command checks its own smaller range (at least 1, at most the documents...)."""
    return typer.Option(default, *names, help=help, min=-MAX_INT, max=MAX_INT)


def quant_option(purpose: str = "") -> Any:
    """--quantize: what the command does with the weights, then the schemes (QUANT_HELP)."""
    return typer.Option("none", "--quantize", help=f"{purpose} {QUANT_HELP}".lstrip())


def with_sampling_flags(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the shared sampling flags in place of its `flags` parameter: it gets them as
    one dict (None: not given), already checked, so a bad flag fails before a checkpoint loads."""
    from quillgpt.config import SampleConfig

    signature = inspect.signature(command)
    shared = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=o, annotation=a) for n, (a, o) in SAMPLING_FLAGS.items()
    ]
    params = [q for p in signature.parameters.values() for q in (shared if p.name == "flags" else [p])]

    @functools.wraps(command)
    def with_flags(**kwargs: Any) -> None:
        flags = {name: kwargs.pop(name) for name in SAMPLING_FLAGS}
        SampleConfig().params(**flags)
        return command(**kwargs, flags=flags)

    with_flags.__signature__ = signature.replace(parameters=params)  # what typer reads
    hints = {k: v for k, v in command.__annotations__.items() if k != "flags"}
    with_flags.__annotations__ = {**hints, **{name: kind for name, (kind, _) in SAMPLING_FLAGS.items()}}
    return with_flags


def _out_path(text: str) -> Path:
    """--out as typed: empty or whitespace is refused here (as Path it would be the current directory)."""
    from quillgpt.files import output_path

    return output_path(text, "--out")


# --- commands (each: parse → one library call → print) ------------------------------------


@app.command("prepare")
def prepare_cmd(
    config: Path = CONFIG_OPT,
    overrides: list[str] | None = OVERRIDES_ARG,
    force: bool = typer.Option(False, "--force", help="Rebuild even when meta.json says the files are up to date."),
) -> None:
    """Tokenize data.path (a text file, a directory or a glob of .txt/.jsonl/.parquet, .gz/.zst too)
    into token shards + meta.json under data.out_dir; a killed run resumes at its last shard."""
    from quillgpt.config import load_config
    from quillgpt.data.prepare import prepare

    cfg = load_config(config, overrides)
    print(prepare(cfg.data, force=force, chat_tokens=cfg.model.block_size + 1).report())


@app.command()
def train(
    config: Path = CONFIG_OPT,
    overrides: list[str] | None = OVERRIDES_ARG,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in train.out_dir from its latest checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run already in train.out_dir (= train.overwrite=true)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Train a GPT: checkpoints, metrics.jsonl and the resolved config go to train.out_dir.

    A train.out_dir that already holds a run is refused unless you say `--resume` (continue it)
    or `--overwrite` (replace it). Ctrl-C saves a checkpoint and exits; `--resume` continues
    exactly where it stopped. Under `torchrun --nproc_per_node N -m quillgpt train ...` it trains with DDP.
    """
    from quillgpt.config import load_config
    from quillgpt.train.loop import train as run_training
    from quillgpt.train.progress import say

    cfg = load_config(config, overrides)
    if resume:
        cfg.train.resume = True
    if overwrite:
        cfg.train.overwrite = True
    result = run_training(cfg, progress=not quiet)
    if int(os.environ.get("RANK", "0")) == 0:  # said to the terminal if Ctrl-C took `| tee` with it
        val = f"{result.last_val_loss:.4f}" if result.last_val_loss is not None else "n/a"
        best = f"{result.best_val_loss:.4f}" if math.isfinite(result.best_val_loss) else "none yet"
        say(f"{result.stopped}: step {result.step}, val loss {val} (best {best}), {result.time_text()} → {result.out_dir}")
        if result.reason:
            say(f"  ({result.reason})")
    if result.stopped == "interrupted":
        raise typer.Exit(130)


@app.command("finetune")
def finetune_cmd(
    base: Path = typer.Argument(..., help="The run to fine-tune: a quill run directory or a `quill import-hf` output."),
    data: Path = typer.Option(..., "--data", "-d", help="Conversations, one JSON object a line (messages, or prompt + completion)."),
    out: Path = typer.Option(..., "--out", "-o", help="Run directory to write (the prepared data goes into OUT/data)."),
    full: bool = typer.Option(False, "--full", help="Train every weight instead of LoRA adapters (rank 8 on every linear)."),
    epochs: int = count_option(3, "--epochs", help="Passes over the conversations."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run already in --out."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    overrides: list[str] | None = OVERRIDES_ARG,
) -> None:
    """Fine-tune a run on conversations with settings sized from the data: batches by a token
    budget (rows as long as their conversations; the model keeps the base's context), steps from
    --epochs, warmup as a fraction of them, the last data.val_fraction held out. Prints the plan,
    then trains (as `quill train`; train.resume=true continues it)."""
    from quillgpt.train.finetune import best_checkpoint, finetune
    from quillgpt.train.progress import say

    extra = [*(overrides or []), *(["train.overwrite=true"] if overwrite else [])]
    _, result = finetune(base, data, out, full=full, epochs=epochs, overrides=extra, progress=not quiet)
    val = f"{result.last_val_loss:.4f}" if result.last_val_loss is not None else "n/a"
    say(f"{result.stopped}: step {result.step}, held-out loss {val}, {result.elapsed_s:.0f}s → {result.out_dir}")
    best = best_checkpoint(result.out_dir)
    if best is not None:  # what a user gets: the lowest held-out loss's weights, not the last step's
        step, loss = best
        latest = "" if step == result.step else f"; step {result.step}'s weights: --which latest"
        say(f"  best.pt (step {step}, held-out loss {loss:.4f}, the lowest) is what chat, merge and export use{latest}")
    say(f"  chat with it: quill chat --ckpt {result.out_dir}; merge it: quill merge {result.out_dir} --out DIR")
    if result.stopped == "interrupted":
        raise typer.Exit(130)


@app.command("sample")
@with_sampling_flags
def sample_cmd(
    ckpt: Path = typer.Option(..., "--ckpt", help="Run directory or .pt file."),
    prompt: str | None = typer.Option(
        None,
        "--prompt",
        "-p",
        help="Text to continue; '-' reads standard input. Default: empty, which starts from <|endoftext|> (BPE) or a newline (char).",
    ),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="Read the prompt from this UTF-8 file (used as is, trailing newline included)."
    ),
    which: str = WHICH_OPT,
    flags: dict[str, Any] = {},  # noqa: B006 (with_sampling_flags puts the shared flags here)
    num_samples: int = count_option(1, "--num-samples", help="Samples of the same prompt, generated together in one batch."),
    stop: list[str] | None = typer.Option(
        None, "--stop", help=r"End a sample at the first occurrence of this text, which is not printed; repeatable; \n \t \\ are escapes."
    ),
    no_kv_cache: bool = typer.Option(
        False, "--no-kv-cache", help="Recompute the whole context at every step (the plain path, for checking; slow)."
    ),
    compile: bool = COMPILE_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    quant: str = quant_option(),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Print text as it is generated, or all at the end."),
    echo: bool = typer.Option(True, "--echo/--no-echo", help="Print the prompt before its continuation."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: prompt, samples (continuations only), settings, stats."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No stats line on stderr."),
) -> None:
    """Continue a prompt with a trained model, streaming the text as it comes.

    With --num-samples N, sample 1 streams under a `--- sample 1 ---` header and samples 2..N
    follow in full when it is done. A stats line (tokens, tokens/s, prefill) goes to stderr.
    """
    from quillgpt.inference.generate import open_sample

    text = _sample_prompt(prompt, prompt_file)
    stops = tuple(_unescape(s) for s in stop or [])
    options = LoadOptions.parse(device=device, dtype=dtype, quantize=quant, which=which, compile=compile)
    sample = open_sample(ckpt, text, options, samples=num_samples, flags=flags, stop=stops, use_cache=not no_kv_cache)
    try:
        if as_json:
            sys.stdout.write(sample.to_json())
        else:
            sample.write(sys.stdout, echo, stream)
        sys.stdout.flush()
    except BrokenPipeError:  # `quill sample ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if not quiet:
        print(sample.stats_line(), file=sys.stderr)


@app.command("chat")
@with_sampling_flags
def chat_cmd(
    ckpt: Path = typer.Option(..., "--ckpt", help="Run directory or .pt file (an imported chat model, or any quill run)."),
    which: str = WHICH_OPT,
    system: str | None = typer.Option(None, "--system", help="A system message that starts the conversation (and stays after /reset)."),
    flags: dict[str, Any] = {},  # noqa: B006 (with_sampling_flags puts the shared flags here)
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    quant: str = quant_option(),
    compile: bool = COMPILE_OPT,
) -> None:
    """Talk to a model in the terminal: each line is a message, the reply streams as it comes.

    An imported model answers through its own chat template and stops at its end-of-turn token;
    a quill-trained (base) model continues a User:/Assistant: transcript. /reset clears the
    conversation, /quit (or Ctrl-D) ends it, Ctrl-C stops one reply.
    """
    from quillgpt.inference.chat_session import open_chat, repl

    options = LoadOptions.parse(device=device, dtype=dtype, quantize=quant, which=which, compile=compile)
    session, header = open_chat(ckpt, options, system, flags)
    print(header, file=sys.stderr)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if hasattr(sys.stdin, "reconfigure"):  # an invalid byte becomes a lone surrogate: that message's error line, not the end
        sys.stdin.reconfigure(errors="surrogateescape")
    repl(
        session,
        input if sys.stdin.isatty() else _read_line,
        write,
        lambda line: print(line, file=sys.stderr),
        tty=sys.stdin.fileno() if sys.stdin.isatty() else None,
    )


@app.command("serve")
def serve_cmd(
    ckpt: Path = typer.Option(..., "--ckpt", help="Run directory or .pt file to serve (fixed for the server's life)."),
    which: str = WHICH_OPT,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; the default is this machine only."),
    port: int = count_option(8000, "--port", help="Port to listen on (0: any free port, printed at start)."),
    api_key: str | None = typer.Option(
        None, "--api-key", help="Require 'Authorization: Bearer KEY' on every /v1 request (or set QUILL_API_KEY)."
    ),
    max_batch: int = count_option(
        16, "--max-batch", help="Requests decoded together (continuous batching); also the most choices (n x prompts) per request."
    ),
    max_tokens: int = count_option(2048, "--max-tokens", help="The largest max_tokens a request may ask for."),
    device: str = DEVICE_OPT,
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16: the weights (a converted copy) and the KV cache."),
    quant: str = quant_option("The weights served (int8's kernel measured at --max-batch rows)."),
    cors: str | None = typer.Option(
        None, "--cors", help="Allow browser pages from this origin (e.g. http://localhost:3000) to call the API; default: none."
    ),
    compile: bool = COMPILE_OPT,
    prompt_cache_mb: int | None = count_option(
        None,
        "--prompt-cache-mb",
        help="MiB of recent prompts' KV kept, so a prompt that starts with one (a chat's next turn, a shared system prompt) prefills only the rest; 0: off. Default: 64k tokens' KV, at most a quarter of the free memory.",
    ),
) -> None:
    """Serve a model over HTTP: an OpenAI-compatible API at /v1 and a web page at /.

    Concurrent requests are decoded together (continuous batching). Ctrl-C (or SIGTERM) stops
    accepting, lets running streams finish for a few seconds, then exits.
    """
    from quillgpt.serve.server import serve

    if api_key is None:  # read here, not by typer: click drops an empty variable, which would serve without a key
        api_key = os.environ.get("QUILL_API_KEY")
    serve(
        ckpt,
        which=which,
        host=host,
        port=port,
        api_key=api_key,
        max_batch=max_batch,
        max_tokens=max_tokens,
        device=device,
        dtype=dtype,
        quantize=quant,
        cors=cors,
        compile=compile,
        prompt_cache_mb=prompt_cache_mb,
    )


@app.command("eval")
def eval_cmd(
    ckpt: list[Path] = typer.Option(..., "--ckpt", help="Run directory or .pt file; repeat to compare several in one table."),
    which: str = WHICH_OPT,
    split: str = typer.Option("val", "--split", help="Prepared split of the run's data.out_dir to score: val or train."),
    text: list[Path] | None = typer.Option(None, "--text", help="Score this UTF-8 file instead of the split; repeatable."),
    text_format: str = typer.Option(
        "text", "--format", help="text, or chat: --text files are jsonl conversations, scored on the assistant's tokens as training does."
    ),
    stride: int | None = count_option(
        None, "--stride", help="Tokens between windows (default block_size); smaller = more context per token, slower."
    ),
    batch_size: int = count_option(16, "--batch-size", help="Windows per forward pass."),
    device: str = DEVICE_OPT,
    quant: str = quant_option("Score the model with these weights, as quill sample --quantize runs it, to see what they cost in loss."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object, or a list for several rows) and no progress bar."),
    skip_unknown: bool = typer.Option(False, "--skip-unknown", help="Drop characters a char vocabulary cannot encode instead of failing."),
    tasks: str | None = typer.Option(
        None, "--tasks", help="lm-evaluation-harness tasks, comma-separated (e.g. hellaswag,arc_easy): scored by lm-eval's evaluator."
    ),
    num_fewshot: int | None = count_option(None, "--num-fewshot", help="--tasks: examples in each prompt (default: the task's own)."),
    limit: float | None = typer.Option(
        None, "--limit", help="--tasks: score only the first N documents of each task (below 1: that fraction)."
    ),
    include_path: Path | None = typer.Option(
        None,
        "--include-path",
        help="--tasks: a folder of task YAML files (local tasks, offline). A task folder is code: see --trust-task-code.",
    ),
    trust_task_code: bool = typer.Option(
        False,
        "--trust-task-code",
        help="--tasks: run the Python that --include-path's YAML names (!function) and its templates outside Jinja's sandbox; "
        "only for a folder you have read.",
    ),
    chat_template: bool = typer.Option(False, "--apply-chat-template", help="--tasks: put each prompt through the model's chat template."),
    output_path: Path | None = typer.Option(None, "--output-path", help="--tasks: write lm-eval's results JSON to this file."),
    dtype: str = typer.Option("float32", "--dtype", help="--tasks: float32, bfloat16 or float16 weights."),
) -> None:
    """Score every token of a split or text once: loss, perplexity, bits per token/byte/char.

    Bits per byte and per character compare models with different tokenizers on the same text.
    Chat data (a run trained on it, or --format chat) counts the assistant's tokens only.
    With --tasks: lm-evaluation-harness tasks instead (accuracy and the tasks' own metrics).
    """
    load = dict(which=which, batch_size=batch_size, device=device, quantize=quant)
    task_settings = dict(
        num_fewshot=num_fewshot,
        limit=limit,
        include_path=include_path,
        output_path=output_path,
        apply_chat_template=chat_template,
        trust_task_code=trust_task_code,
        dtype=dtype,
    )
    texts = dict(split=split, texts=text, text_format=text_format, stride=stride, skip_unknown=skip_unknown)
    if tasks is not None:
        _eval_tasks(ckpt, tasks, as_json, task_settings, load, texts)
    else:
        _eval_texts(ckpt, as_json, task_settings, load, texts)


def _eval_texts(ckpt: list[Path], as_json: bool, task_settings: dict[str, Any], load: dict[str, Any], texts: dict[str, Any]) -> None:
    """quill eval without --tasks: each run's loss on a split or texts (the table, or JSON)."""
    _refuse_task_flags(task_settings)
    from quillgpt.evaluate.scores import evaluate_checkpoints

    scores = evaluate_checkpoints(ckpt, progress=not as_json, **texts, **load)
    print(scores.to_json() if as_json else scores.table())


def _eval_tasks(ckpt: list[Path], tasks: str, as_json: bool, settings: dict[str, Any], load: dict[str, Any], texts: dict[str, Any]) -> None:
    """quill eval --tasks: each run scored on lm-eval's tasks (the table, or one JSON line)."""
    if texts["texts"] or texts["split"] != "val" or texts["stride"] is not None or texts["text_format"] != "text":
        raise QuillError("--tasks scores lm-eval tasks: --text, --split, --stride and --format do not apply")
    from quillgpt.evaluate.harness import evaluate_runs  # QuillError without lm-eval

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    done = evaluate_runs(ckpt, names, announce=None if as_json else print, **settings, **load)
    if as_json:
        print(done.to_json())


TASK_FLAGS = {  # eval's settings that only --tasks reads → their flags, in the order they are named
    "num_fewshot": "--num-fewshot",
    "limit": "--limit",
    "include_path": "--include-path",
    "output_path": "--output-path",
    "apply_chat_template": "--apply-chat-template",
    "trust_task_code": "--trust-task-code",
}


def _refuse_task_flags(settings: dict[str, Any]) -> None:
    """A flag of lm-eval tasks given without --tasks: one line naming the first."""
    used = [flag for key, flag in TASK_FLAGS.items() if settings[key] not in (None, False)]
    if used or settings["dtype"] != "float32":
        raise QuillError(f"{(used or ['--dtype'])[0]} applies to lm-eval tasks: add --tasks T1,T2")


@app.command("attention")
def attention_cmd(
    ckpt: Path = typer.Option(..., "--ckpt", help="Run directory or .pt file."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Text to run once; longer than block_size keeps the last block_size tokens."),
    which: str = WHICH_OPT,
    layer: str = typer.Option(
        "-1", "--layer", help="Layer to show (negative counts from the end; default -1 = last) or 'all' for a layer × head grid."
    ),
    head: int | None = count_option(None, "--head", help="Show one head as a single large map (default: every head)."),
    out: Path | None = typer.Option(
        None, "--out", "-o", parser=_out_path, help="Image to write, .png or .svg; without it a text view is printed."
    ),
    fmt: str | None = typer.Option(
        None,
        "--format",
        help="png, svg or text (default: from --out's extension, text without --out; png/svg without --out write attention.png/.svg).",
    ),
    top_k: int = count_option(3, "--top-k", help="Text view: attended tokens listed per query token."),
    summary_json: Path | None = typer.Option(
        None, "--summary-json", help="Where to save the per-head summary (default: <out stem>.heads.json beside --out)."
    ),
    device: str = typer.Option("cpu", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    quant: str = quant_option("The attention of the model with these weights (as quill sample --quantize runs it)."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace an existing file at --out / --summary-json that is not an earlier image / summary (e.g. a run's file).",
    ),
) -> None:
    """Show where each head looks: heatmaps (or a text view) plus a per-head summary.

    The summary gives each head's mean attention distance, entropy and weight on the first
    token, the numbers that tell local heads from far-looking and first-token ("sink") heads.
    """
    from quillgpt.evaluate.attention_views import AttentionRequest, attention_report

    options = LoadOptions.parse(device=device, quantize=quant, which=which)
    report = attention_report(ckpt, options, AttentionRequest(prompt, layer, head, out, fmt, top_k, summary_json, force))
    if report.note is not None:
        print(report.note, file=sys.stderr)
    print(report.text)


@app.command("plot")
def plot_cmd(
    run_dirs: list[Path] = typer.Argument(..., help="One or more run directories (each with metrics.jsonl)."),
    out: Path = typer.Option(Path("curves.png"), "--out", "-o", parser=_out_path, help="Image to write, .png or .svg."),
    x: str = typer.Option("step", "--x", help="x axis: step, tokens (step × batch_size·grad_accum·block_size) or time (elapsed_s)."),
    log: bool = typer.Option(False, "--log", help="Log-scale loss axis."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out that is not an earlier plot image (e.g. a run's file)."),
) -> None:
    """Train and val loss of one or more runs on one plot (works while a run is training)."""
    from quillgpt.evaluate.curves import plot_runs

    kind = out.suffix.lower().lstrip(".")
    check_output_file(
        out, "--out", kind=kind if kind in ("png", "svg") else None, force=force, inputs=tuple(Path(d) / "metrics.jsonl" for d in run_dirs)
    )
    for c in plot_runs(run_dirs, out, x=x, log=log, force=force):
        best = f"best val {min(c.val[1]):.4f}" if c.val[1] else "no val points yet"
        print(f"{c.name}: step {c.last_step}, last train {c.train[1][-1]:.4f}, {best}")
    print(f"saved → {out}")


@app.command("import-hf")
def import_hf_cmd(
    src: str = typer.Argument(
        ...,
        help="Hugging Face model directory (config.json, model.safetensors or pytorch_model.bin, tokenizer files) of GPT-2, Llama, Qwen2, Qwen3 or Mistral, or a hub name such as gpt2.",
    ),
    out: Path = typer.Option(..., "--out", "-o", parser=_out_path, help="Run directory to write: config.yaml, tokenizer.json, ckpt.pt."),
    force: bool = typer.Option(False, "--force", help="Overwrite a run already in --out."),
) -> None:
    """Import a Hugging Face model (GPT-2 or the Llama family) as a quill run: sample, chat, eval, fine-tune it."""
    from quillgpt.interop.convert import import_hf

    _print_imported(src, import_hf(src, out, force=force))


def _print_imported(src: str | Path, done: Converted) -> None:
    """import-hf's and import-gguf's one line: what was written, its shape, and the next command."""
    m = done.model
    print(
        f"imported {src} ({done.architecture}) → {done.path}: {m.n_layer} layers, {m.n_head} heads ({m.kv_heads} K/V), "
        f"{m.n_embd} wide, block_size {m.block_size:,}, vocab {m.vocab_size:,}, tokenizer {done.tokenizer}; "
        + (
            f"{done.note}; chat with `quill chat --ckpt {done.path}`, fine-tune (LoRA) with `quill finetune {done.path} --data CHATS.jsonl -o OUT`"
            if done.note
            else f"chat with `quill chat --ckpt {done.path}`, fine-tune with `quill finetune {done.path} --data CHATS.jsonl -o OUT`"
        )
    )


@app.command("export-hf")
def export_hf_cmd(
    run: Path = typer.Argument(..., help="Run directory or .pt file to export."),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        parser=_out_path,
        help="Directory to write: config.json, model.safetensors, generation_config.json and tokenizer files.",
    ),
    which: str = WHICH_OPT,
    force: bool = typer.Option(False, "--force", help="Overwrite a model already in --out."),
) -> None:
    """Export a run for transformers: GPT-2 (learned positions, LayerNorm, GELU) or the Llama family (RoPE, RMSNorm, SwiGLU)."""
    from quillgpt.interop.convert import export_hf

    done = export_hf(run, out, which=which, force=force)
    print(
        f"exported {run} ({which}) → {done.path} as {done.architecture}: load with "
        f"transformers.AutoModelForCausalLM.from_pretrained({str(done.path)!r})"
    )


@app.command("import-gguf")
def import_gguf_cmd(
    src: Path = typer.Argument(..., help="GGUF file of llama.cpp's llama (Llama, Mistral, SmolLM...), qwen2, qwen3, gemma3 or gpt2."),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        parser=_out_path,
        help="Run directory to write: config.yaml, tokenizer.json, ckpt.pt (+ weights.safetensors, quantized).",
    ),
    dequantize: bool = typer.Option(
        False, "--dequantize", help="Write fp32 weights instead of keeping the file's quantization (a run you can fine-tune)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite a run already in --out."),
) -> None:
    """Import a GGUF file as a quill run, its quantization kept (Q4 → int4, Q5/Q6/Q8 → int8): sample, chat, eval, serve it."""
    from quillgpt.interop.gguf_import import import_gguf

    _print_imported(src, import_gguf(src, out, force=force, dequantize=dequantize))


@app.command("quantize")
def quantize_cmd(
    run: Path = typer.Argument(..., help="Run directory (or .pt) with float weights: trained, import-hf'd or import-gguf --dequantize'd."),
    out: Path = typer.Option(..., "--out", "-o", parser=_out_path, help="Run directory to write the quantized run to."),
    quantize: str = typer.Option(..., "--quantize", "-q", help=QUANT_HELP),
    which: str = typer.Option("best", "--which", help="Checkpoint: best or latest."),
    force: bool = typer.Option(False, "--force", help="Overwrite a run already in --out."),
) -> None:
    """Write a run's weights quantized once (what --quantize does at every load), to load in seconds."""
    from quillgpt.runs import quantize_run

    done = quantize_run(run, out, quantize, which=which, force=force)
    size = sum(p.stat().st_size for p in done.iterdir() if p.is_file())
    print(f"quantized {run} ({which}) to {quantize} → {done} ({size / 1e6:,.1f} MB): `quill chat --ckpt {done}`")


@app.command("export-gguf")
def export_gguf_cmd(
    run: Path = typer.Argument(..., help="Run directory or .pt file to export."),
    out: Path = typer.Option(..., "--out", "-o", help="GGUF file to write."),
    kind: str = typer.Option("f32", "--type", help="The matrices' type: f32, f16, bf16 or q8_0 (norms and biases stay f32)."),
    which: str = WHICH_OPT,
    ollama: bool = typer.Option(False, "--ollama", help="Also write an Ollama Modelfile beside the file."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Export a run as one GGUF file for llama.cpp, Ollama, LM Studio and transformers (gguf_file=)."""
    from quillgpt.interop.gguf_write import export_gguf

    done = export_gguf(run, out, kind=kind, which=which, force=force, ollama=ollama)
    size = done.path.stat().st_size / 1e6
    print(f"exported {run} ({which}) → {done.path} ({done.arch}, {done.type}, {size:.1f} MB): run it with `llama-cli -m {done.path}`")
    if done.modelfile is not None:
        print(f"wrote {done.modelfile}; then: cd {done.modelfile.parent} && ollama create {done.path.stem} -f Modelfile")


@app.command("merge")
def merge_cmd(
    run: Path = typer.Argument(..., help="A LoRA run directory (lora.rank > 0) or its .pt file."),
    out: Path = typer.Option(..., "--out", "-o", parser=_out_path, help="Run directory to write: config.yaml, tokenizer.json, ckpt.pt."),
    which: str = WHICH_OPT,
    force: bool = typer.Option(False, "--force", help="Overwrite a run already in --out."),
) -> None:
    """Merge a LoRA run's adapters into its base: a plain run that needs neither (every command
    also takes the LoRA run directly, merging at load)."""

    path = merge_run(run, out, which=which, force=force)
    print(f"merged {run} ({which}) into its base → {path}: use it as any run, or fine-tune it with train.init_from={out}")


def _sample_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text from --prompt, --prompt-file or standard input (--prompt -); default ""."""
    if prompt is not None and prompt_file is not None:
        raise QuillError("pass the prompt once: --prompt or --prompt-file, not both")
    if prompt_file is None and prompt != "-":
        return prompt or ""
    where = "standard input" if prompt_file is None else f"--prompt-file {prompt_file}"
    try:
        if prompt_file is not None:
            check_input(prompt_file, "--prompt-file")  # a FIFO or device is refused by name, unread
        with open(prompt_file, "rb") if prompt_file is not None else contextlib.nullcontext(sys.stdin.buffer) as f:
            data = f.read(MAX_PROMPT_BYTES + 1)  # an endless stream stops here
    except OSError as e:
        raise QuillError(f"cannot read {where}: {e.strerror}") from None
    if len(data) > MAX_PROMPT_BYTES:  # more characters than MAX_PROMPT_CHARS, at 4 bytes a character
        raise _too_long(where)
    try:
        return _bounded_prompt(data.decode("utf-8"), where)
    except UnicodeDecodeError as e:
        raise QuillError(f"{where} is not UTF-8 text (invalid byte at offset {e.start})") from None


def _bounded_prompt(text: str, where: str) -> str:
    """A prompt of at most MAX_PROMPT_CHARS characters, else one line saying the bound."""
    if len(text) > MAX_PROMPT_CHARS:
        raise _too_long(where)
    return text


def _too_long(where: str) -> QuillError:
    return QuillError(f"{where} holds more than {MAX_PROMPT_CHARS:,} characters, far more than any model's context; pass a shorter prompt")


def _read_line(prompt: str) -> str:
    """input() for chat's piped standard input, one line bounded (a stream with no newline,
    such as /dev/zero, would grow until memory ran out)."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline(MAX_PROMPT_CHARS + 1)
    if not line:
        raise EOFError
    return _bounded_prompt(line, "a line of standard input").removesuffix("\n")


def _unescape(text: str) -> str:
    r"""`--stop '\n\n'` means two newlines: \n, \t, \r and \\ are read as escapes."""
    import re

    return re.sub(r"\\([ntr\\])", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group(1)], text)


tokenizer_app = typer.Typer(help="Tokenizers: train a byte-level BPE on your own text.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")


@tokenizer_app.command("train")
def tokenizer_train_cmd(
    input_path: Path = typer.Option(..., "--input", "-i", help="UTF-8 text file to learn the BPE merges from."),
    vocab_size: int = count_option(4096, "--vocab-size", help="Ids in the vocabulary: 256 bytes + merges + <|endoftext|>."),
    out: Path = typer.Option(
        Path("tokenizer.json"), "--out", "-o", parser=_out_path, help="Where to write the tokenizer JSON (a new file unless --force)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite --out when it exists."),
) -> None:
    """Train a byte-level BPE tokenizer on a text file and save it as JSON."""
    from quillgpt.data.tokenizer_files import train_tokenizer

    print(train_tokenizer(input_path, vocab_size, out, force=force).line())


# --- end of commands ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Entry point of `quill` and `python -m quillgpt`: user mistakes exit 2 with one line."""
    debug = os.environ.get("QUILL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
    try:
        code = app(args=argv, standalone_mode=False)
    except QuillError as e:
        if debug:
            raise
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except CLICK_ERROR as e:  # bad flags: one line, not a box
        if debug:
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # plain `quill`: the help is the answer
            e.show()
            sys.exit(e.exit_code)
        print(f"error: {_one_line(e.format_message())} (see {_command_of(e)} --help)", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full disk is the user's to fix, wherever the write happened
        if debug or e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" while writing {e.filename}" if e.filename else ""
        print(f"error: {e.strerror}{where}; free disk space (or write elsewhere) and run again", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


def _command_of(error: Exception) -> str:
    """'quill eval' for a mistake in quill eval's flags (the subcommand's own --help), else 'quill'."""
    names, ctx = [], getattr(error, "ctx", None)
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["quill", *reversed(names)])


def _one_line(message: str, limit: int = 2000) -> str:
    """The error line as promised: newlines (from a user's value) escaped, length bounded."""
    text = message.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."
