"""lm-eval task folders (`quill eval --tasks … --include-path DIR`) checked before a model loads.

A task folder is code: lm-eval's YAML may name Python with `!function` (imported from the
folder, or from anywhere on the path) and renders its templates with Jinja, which unsandboxed
can reach Python's internals. So without `--trust-task-code` (lm-eval's own CLI asks for
`--trust_remote_code` / `--confirm_run_unsafe_code` the same way) a folder whose YAML names code
is refused before lm-eval reads it, and every template renders in Jinja's sandbox. Then each
task is loaded with lm-eval's own loader and its first document put through its templates, so a
malformed task (no dataset, no doc_to_text, no test split, a bad output_type or metric, a
template error, missing data files, a group that includes itself) is one line naming the task,
not a traceback halfway through the evaluation. --limit and --num-fewshot are bounded here too.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from quillgpt.config import MAX_INT
from quillgpt.errors import QuillError
from quillgpt.files import check_input, read_text, shown

TRUST_FLAG = "--trust-task-code"
MAX_TASK_FILES = 10_000  # YAML files in a task folder (and the files they include)
MAX_YAML_BYTES = 1 << 20  # one task YAML
MAX_FEWSHOT = 1024  # examples in a prompt: far beyond any task's; the documents available bound it too
OUTPUT_TYPES = ("loglikelihood", "multiple_choice", "loglikelihood_rolling", "generate_until")
CODE_TAGS = ("!function", "tag:yaml.org,2002:python/")  # what makes lm-eval's loader import or build Python


def check_limits(limit: float | None, num_fewshot: int | None) -> None:
    """--limit: a count of documents (a whole number from 1) or a fraction in (0, 1), as lm-eval
    reads it; --num-fewshot: 0 to MAX_FEWSHOT (and at most the task's documents: check_tasks)."""
    if limit is not None:
        whole = math.isfinite(limit) and limit == int(limit) and 1 <= limit <= MAX_INT
        if not (0 < limit < 1 or whole):
            raise QuillError(
                f"--limit must be a number of documents (a whole number from 1) or a fraction in (0, 1), got {limit}; "
                "e.g. --limit 100 or --limit 0.1"
            )
    if num_fewshot is not None and not 0 <= num_fewshot <= MAX_FEWSHOT:
        raise QuillError(f"--num-fewshot must be between 0 and {MAX_FEWSHOT:,} examples, got {num_fewshot}")


# --- code in a task folder ---------------------------------------------------------------------


def check_task_code(folder: Path, trust: bool) -> None:
    """Refuse a task folder whose YAML (or a file it includes) names Python, unless trusted."""
    if trust:
        return
    found = code_in_folder(folder)
    if found:
        path, line, what = found
        raise QuillError(
            f"--include-path {shown(folder)}: {shown(path)} line {line} has {what}, which runs Python from the task folder "
            f"(a task folder is code); read it, and pass {TRUST_FLAG} if you trust it"
        )


def code_in_folder(folder: Path) -> tuple[Path, int, str] | None:
    """The first YAML node that names code (file, line, tag and value), following `include:`."""
    pending, seen = sorted(folder.glob("**/*.yaml")), set()
    while pending:
        path = pending.pop(0).resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        if len(seen) > MAX_TASK_FILES:
            raise QuillError(f"--include-path {shown(folder)} holds over {MAX_TASK_FILES:,} task YAML files; pass the task's own folder")
        root = _compose(path)
        if root is None:
            continue
        found = _code_node(root)
        if found is not None:
            return path, found.start_mark.line + 1, f"{found.tag} {str(found.value)[:80]!r}"
        pending += [p if p.is_absolute() else path.parent / p for p in _includes(root)]
    return None


def _compose(path: Path) -> yaml.Node | None:
    """One YAML file's node graph (nothing constructed: no tag runs), or one line saying why not."""
    text = read_text(path, "task YAML", limit=MAX_YAML_BYTES)
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError) as e:
        raise QuillError(f"task YAML {shown(path)} is not valid YAML ({str(e).splitlines()[0][:120]})") from None


def _code_node(root: yaml.Node) -> yaml.Node | None:
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.tag.startswith(CODE_TAGS):
            return node
        if isinstance(node, yaml.SequenceNode):
            stack += node.value
        elif isinstance(node, yaml.MappingNode):
            stack += [n for pair in node.value for n in pair]
    return None


def _includes(root: yaml.Node) -> list[Path]:
    """The files a task YAML's top-level `include:` names (one, or a list)."""
    if not isinstance(root, yaml.MappingNode):
        return []
    for key, value in root.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "include":
            items = value.value if isinstance(value, yaml.SequenceNode) else [value]
            return [Path(n.value).expanduser() for n in items if isinstance(n, yaml.ScalarNode)]
    return []


@contextlib.contextmanager
def sandboxed_templates(trust: bool) -> Iterator[None]:
    """lm-eval renders every template with one module-level Jinja Environment: while this is
    open (and the task code is not trusted) it is Jinja's SandboxedEnvironment instead, with the
    same settings and filters, so a template cannot reach Python's internals."""
    import lm_eval.utils as lm_utils
    from jinja2.sandbox import SandboxedEnvironment

    if trust:
        yield
        return
    own = lm_utils.env
    sandbox = SandboxedEnvironment(loader=own.loader, undefined=own.undefined, keep_trailing_newline=own.keep_trailing_newline)
    sandbox.filters.update(own.filters)
    lm_utils.env = sandbox
    try:
        yield
    finally:
        lm_utils.env = own


# --- each task, by lm-eval's own loader -------------------------------------------------------


def check_tasks(manager: Any, tasks: list[str], num_fewshot: int | None) -> None:
    """Each task (and every task of a group) as lm-eval builds it, its first document put through
    its templates; the folder's own tasks first checked field by field, so that lm-eval's
    unhelpful errors (a TypeError for a missing dataset_path) become a line naming the field."""
    with quiet_loading():
        for name in tasks:
            _check_entries(manager, name, ())
            try:
                loaded = list(manager.load([name])["tasks"].values())  # every task of a group or tag
            except RecursionError:
                raise QuillError(f"task {name}: a group that includes itself (directly or through another group)") from None
            except Exception as e:  # noqa: BLE001 — lm-eval and datasets fail with any type
                raise QuillError(f"task {name}: lm-eval cannot load it ({_first_line(e)})") from None
            for task in loaded:
                _probe(task, num_fewshot)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """datasets' progress bars and lm-eval's warnings off while the tasks are checked (each task
    is built again, and says so, when it is evaluated): a refusal stays one line."""
    import datasets

    was_on, logger = datasets.is_progress_bar_enabled(), logging.getLogger("lm_eval")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if was_on:
            datasets.enable_progress_bars()


def _check_entries(manager: Any, name: str, path: tuple[str, ...]) -> None:
    """A group's tasks, recursively (a cycle named), and each task's config fields."""
    if name in path:
        raise QuillError(f"task {path[0]}: group {name} includes itself ({' → '.join((*path, name))})")
    entry = manager.task_index.get(name)
    if entry is None or entry.cfg is None or "/lm_eval/tasks/" in str(entry.yaml_path):
        return  # a tag, an inline task or one of lm-eval's own
    if "group" in entry.cfg:
        members = entry.cfg.get("task") or []
        for member in members if isinstance(members, list) else [members]:
            if isinstance(member, str):
                _check_entries(manager, member, (*path, name))
    elif "task" in entry.cfg and "class" not in entry.cfg:
        _check_fields(name, entry.cfg)


def _check_fields(name: str, cfg: dict[str, Any]) -> None:
    """What lm-eval needs of a YAML task before it can build it."""
    from lm_eval.api.registry import get_metric_aggregation, metric_registry

    missing = [k for k in ("dataset_path", "doc_to_text") if cfg.get(k) is None]
    if missing:
        raise QuillError(f"task {name}: its YAML has no {missing[0]} (lm-eval needs dataset_path, doc_to_text and a test split)")
    if cfg.get("test_split") is None and cfg.get("validation_split") is None:
        raise QuillError(f"task {name}: its YAML has no test_split (or validation_split): lm-eval scores one of them")
    _check_data_files(name, cfg)
    kind = cfg.get("output_type", "generate_until")
    if kind not in OUTPUT_TYPES:
        raise QuillError(f"task {name}: output_type {str(kind)[:60]!r} is not one of {', '.join(OUTPUT_TYPES)}")
    metrics = cfg.get("metric_list") or []
    for item in metrics if isinstance(metrics, list) else [metrics]:
        metric = item.get("metric") if isinstance(item, dict) else item
        if isinstance(metric, str) and metric.startswith("/"):  # a !function (read unresolved: its path), allowed only when trusted
            continue
        if not isinstance(metric, str) or (metric not in metric_registry and get_metric_aggregation(metric) is None):
            raise QuillError(f"task {name}: unknown metric {str(metric)[:60]!r} (not one of lm-eval's metrics)")


def _check_data_files(name: str, cfg: dict[str, Any]) -> None:
    """A local task's data files (dataset_kwargs.data_files): each one there and a regular file
    (a device or FIFO would be read forever); URLs and globs are the datasets library's to resolve."""
    kwargs = cfg.get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    values = files.values() if isinstance(files, dict) else [files]
    paths = [p for v in values for p in (v if isinstance(v, list) else [v]) if isinstance(p, str)]
    for path in paths:
        if "://" in path or any(c in path for c in "*?["):
            continue
        try:
            check_input(path, f"task {name}: data file")
        except FileNotFoundError:
            raise QuillError(f"task {name}: data file {shown(Path(path))} does not exist (dataset_kwargs.data_files)") from None
        except OSError as e:
            raise QuillError(f"task {name}: cannot read data file {shown(Path(path))}: {e.strerror}") from None


def _probe(task: Any, num_fewshot: int | None) -> None:
    """The task's first document through doc_to_text / doc_to_target (/ doc_to_choice), and
    --num-fewshot against the documents it can draw examples from."""
    cfg = task.config
    try:
        docs = task.eval_docs
        if len(docs) == 0:
            raise QuillError(f"task {cfg.task}: its test split has no documents")
        task.doc_to_text(docs[0])
        task.doc_to_target(docs[0])
        if cfg.output_type == "multiple_choice":
            task.doc_to_choice(docs[0])
        pool = task.fewshot_docs() if num_fewshot else None
    except QuillError:
        raise
    except Exception as e:  # noqa: BLE001 — a template's error, the sandbox's refusal, a missing field
        raise QuillError(f"task {cfg.task}: its first document does not render ({_first_line(e)})") from None
    if not num_fewshot:
        return
    if cfg.output_type == "loglikelihood_rolling":
        raise QuillError(f"--num-fewshot {num_fewshot}: task {cfg.task} scores whole texts (loglikelihood_rolling), which take no examples")
    eval_split = cfg.test_split or cfg.validation_split
    shots_split = cfg.fewshot_split or cfg.training_split or cfg.validation_split or cfg.test_split
    available = len(pool or []) - (shots_split == eval_split)  # drawn from the same split: never the document itself
    if num_fewshot > available:
        raise QuillError(f"--num-fewshot {num_fewshot}: task {cfg.task} has only {max(available, 0)} documents to draw examples from")


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {text}" if text and text != "None" else type(e).__name__
