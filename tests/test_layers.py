"""The import directions CONTRIBUTING.md's layer table gives: no import circle between modules
(lazy imports inside functions included), and no package importing one of a higher layer."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "quillgpt"

# bottom to top; a package may import its own layer's modules only within itself, and any lower layer
LAYERS = [
    {"errors"},
    {"files", "device", "sampling_params", "native", "cpu_share", "huge_pages"},
    {"config", "metrics_log"},
    {"data", "model", "checkpoint", "tensor_file"},
    {"quant"},
    {"runs"},
    {"inference"},
    {"evaluate"},
    {"train", "interop"},
    {"serve"},
    {"cli"},
    {"__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each quillgpt module → the quillgpt modules it imports anywhere in its file."""
    names = {}
    for f in root.rglob("*.py"):
        parts = ("quillgpt", *f.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    edges = {}
    for name, f in names.items():
        package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in names else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        edges[name] = {m for m in found if m in names and m != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def top(module: str) -> str:
    """The package (or top-level module) a module belongs to; the quillgpt package itself is "errors"'s
    layer: its __init__ imports nothing."""
    return module.split(".")[1] if "." in module else "errors"


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} imports {b}"
        for a, targets in sorted(edges.items())
        for b in sorted(targets)
        if top(a) != top(b) and LAYER[top(b)] >= LAYER[top(a)]
    ]


def test_every_package_has_a_layer():
    assert {top(m) for m in module_imports()} <= set(LAYER)


def test_no_import_circle():
    assert cycles(module_imports()) == []


def test_no_import_runs_up_or_sideways():
    assert upward_imports(module_imports()) == []


@pytest.mark.parametrize(
    "edges, cycle, up",
    [
        ({"quillgpt.config": {"quillgpt.inference.sampling"}, "quillgpt.inference.sampling": {"quillgpt.config"}}, True, True),
        ({"quillgpt.data.a": {"quillgpt.data.b"}, "quillgpt.data.b": {"quillgpt.data.a"}}, True, False),
        ({"quillgpt.model.gpt": {"quillgpt.train.loop"}, "quillgpt.train.loop": set()}, False, True),
        ({"quillgpt.train.loop": {"quillgpt.interop.convert"}, "quillgpt.interop.convert": set()}, False, True),
        ({"quillgpt.train.loop": {"quillgpt.model.gpt"}, "quillgpt.model.gpt": set()}, False, False),
    ],
)
def test_the_checks_find_what_they_look_for(edges, cycle, up):
    assert bool(cycles(edges)) == cycle
    assert bool(upward_imports(edges)) == up


def test_lazy_imports_count(tmp_path):
    pkg = tmp_path / "quillgpt"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from quillgpt.model import gpt\n")
    (pkg / "model" / "gpt.py").write_text("from quillgpt.config import f\n")
    assert cycles(module_imports(pkg)) == [["quillgpt.config", "quillgpt.model.gpt"]]


# model/ is the pure model: no files, environment, native code or state beyond its modules' own
IMPURE_IMPORTS = {"os", "pathlib", "json", "tempfile", "shutil", "subprocess", "torch.utils.cpp_extension", "quillgpt.native"}
IMPURE_CALLS = {
    "open",
    "getenv",
    "register_module_module_registration_hook",
    "register_module_forward_hook",
    "register_module_buffer_registration_hook",
}


def impurities(root: Path) -> list[str]:
    """What a module under `root` does that model/ must not: import a file, environment or native
    module, call open/getenv or a process-wide module hook, rebind a module global (`global`), or
    read os.environ."""
    found = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            bad = [n for n in names if any(n == m or n.startswith(m + ".") for m in IMPURE_IMPORTS)]
            if isinstance(node, ast.Global):
                bad.append(f"global {', '.join(node.names)}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in IMPURE_CALLS:
                bad.append(f"calls {getattr(node.func, 'attr', getattr(node.func, 'id', None))}")
            if isinstance(node, ast.Attribute) and node.attr == "environ":
                bad.append("reads environ")
            found += [f"{f.relative_to(root.parent)}:{node.lineno}: {b}" for b in bad]
    return found


def test_the_model_reads_no_files_environment_or_native_code_and_keeps_no_mutable_globals():
    assert impurities(PACKAGE / "model") == []


def test_the_purity_check_finds_what_it_looks_for(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.py").write_text(
        "import os\nfrom quillgpt.native import kernels\nimport torch\n_n = 0\ndef f():\n    global _n\n    return open('x'), os.environ\n"
        "torch.nn.modules.module.register_module_module_registration_hook(print)\n"
    )
    found = sorted(line.split(": ", 1)[1] for line in impurities(tmp_path / "model"))
    hook = "calls register_module_module_registration_hook"
    assert found == sorted(["os", "quillgpt.native", "quillgpt.native.kernels", "global _n", "calls open", "reads environ", hook])
