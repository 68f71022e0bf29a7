"""The README and docs/ say only what the code does: every `quill` command and flag they show
exists, every config key they name is in the schema, and every file they point at is there."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import typer

from quillgpt.cli import app
from quillgpt.config import Config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FILE_SUFFIXES = {"py", "pt", "bin", "json", "jsonl", "yaml", "txt", "png", "safetensors", "md", "npy", "zst", "parquet", "gz"}


def code_of(text: str) -> list[str]:
    """The code a page shows: its fenced blocks (continued lines joined) and inline spans."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    indented = re.findall(r"(?:^(?: {4}|\t).*\n?)+", rest, flags=re.M)  # four-space code blocks
    spans = re.findall(r"`([^`\n]+)`", rest)
    return [b.replace("\\\n", " ") for b in blocks + indented] + spans


def commands() -> dict[str, set[str]]:
    """Every `quill` command (`tokenizer train` included) and the flags it takes."""
    group = typer.main.get_command(app)
    found = {}
    for name, cmd in group.commands.items():
        subs = getattr(cmd, "commands", None)
        for sub_name, sub in (subs or {name: cmd}).items():
            key = f"{name} {sub_name}" if subs else name
            found[key] = {opt for p in sub.params for opt in (*p.opts, *p.secondary_opts)}
    return found


def schema() -> dict[str, set[str]]:
    """Each config section and its keys."""
    hints = typing.get_type_hints(Config)
    return {f.name: {g.name for g in dataclasses.fields(hints[f.name])} for f in dataclasses.fields(Config)}


def invocations(code: str) -> list[tuple[str, list[str]]]:
    """(command, its words) for each `quill ...` in the code, up to a pipe, `&&`, `;` or comment."""
    found = []
    for line in code.splitlines():
        line = line.split(" #")[0].removeprefix("$ ")
        for part in re.split(r"&&|\|\||[|;]", line):
            words = part.split()
            for i, word in enumerate(words):
                if word in ("quill", "quillgpt") and i + 1 < len(words) and re.fullmatch(r"[a-z][a-z-]*", words[i + 1]):
                    if word == "quillgpt" and (i == 0 or words[i - 1] != "-m"):
                        continue
                    name = words[i + 1]
                    rest = words[i + 2 :]
                    if name == "tokenizer" and rest[:1] == ["train"]:
                        name, rest = "tokenizer train", rest[1:]
                    found.append((name, rest))
    return found


def config_keys(code: str) -> set[tuple[str, str]]:
    """section.key names in the code (file names such as model.safetensors left out)."""
    keys = set()
    for section, key in re.findall(r"(?<![\w/.-])(data|model|train|lora|sample)\.([a-z_][a-z0-9_]*)\b(?![/-])", code):
        if key not in FILE_SUFFIXES:
            keys.add((section, key))
    return keys


def yaml_keys(text: str) -> set[tuple[str, str]]:
    """section: / key: pairs of the ```yaml blocks a page shows."""
    keys = set()
    for block in re.findall(r"^```yaml\n(.*?)^```", text, flags=re.S | re.M):
        section = None
        for line in block.splitlines():
            if m := re.match(r"^([a-z_]+):\s*(#.*)?$", line):
                section = m.group(1)
            elif (m := re.match(r"^\s+([a-z_][a-z0-9_]*):", line)) and section:
                keys.add((section, m.group(1)))
    return keys


def problems(text: str) -> list[str]:
    """What a page shows that the code does not have."""
    cmds, fields, wrong = commands(), schema(), []
    for code in code_of(text):
        for name, words in invocations(code):
            if name not in cmds:
                wrong.append(f"quill {name}: no such command")
                continue
            for word in words:
                flag = word.split("=")[0]
                if re.fullmatch(r"--?[a-zA-Z][\w-]*", flag) and flag not in cmds[name]:
                    wrong.append(f"quill {name} {flag}: no such flag")
        for section, key in config_keys(code):
            if key not in fields[section]:
                wrong.append(f"{section}.{key}: no such config key")
    for section, key in yaml_keys(text):
        if section in fields and key not in fields[section]:
            wrong.append(f"yaml {section}: {key}: no such config key")
    return sorted(set(wrong))


def test_the_check_finds_a_made_up_command_flag_and_key():
    page = (
        "Run `quill train --config c.yaml --resum train.max_itres=3` then\n\n"
        "    quill sample --ckpt out/x -n 3 \\\n        --temprature 0.5 && quill smaple\n\n"
        "```yaml\nmodel:\n  n_layers: 2\n  n_layer: 2\n```\nand `model.safetensors`, `quill tokenizer train --vocab-size 300`.\n"
    )
    assert problems(page) == [
        "quill sample --temprature: no such flag",
        "quill smaple: no such command",
        "quill train --resum: no such flag",
        "train.max_itres: no such config key",
        "yaml model: n_layers: no such config key",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_flags_and_keys_a_page_shows_exist(page):
    if not page.exists():
        pytest.skip(f"{page.name} not written")
    wrong = problems(page.read_text(encoding="utf-8"))
    assert not wrong, f"{page.name}: " + "; ".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_files_a_page_links_or_names_exist(page):
    if not page.exists():
        pytest.skip(f"{page.name} not written")
    text = page.read_text(encoding="utf-8")
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://|mailto:", target) and not (page.parent / target).exists():
            missing.append(target)
    for code in code_of(text):
        for path in re.findall(r"(?<![\w/.])((?:configs|scripts|docs)/[\w./-]+\.(?:yaml|py|sh|md|png))", code):
            if not (ROOT / path).exists():
                missing.append(path)
    assert not missing, f"{page.name} points at files that are not there: {sorted(set(missing))}"
