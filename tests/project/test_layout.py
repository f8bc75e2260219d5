"""The project's shape: imports flow one way with no cycles, every folder says what it owns, and
the text of the tree speaks of the software rather than of how it was made."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compiled", "cli")
# Folders that must not reach into the runtime, the compilation or the CLI.
LOWER = ("compiled.graphs", "compiled.passes", "compiled.attention", "compiled.moe", "compiled.linear",
         "compiled.lora")
UPPER = ("compiled.runtime", "cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (anywhere in the file, lazy imports included)."""
    found = set()
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
            # `from P import x` inside package P runs P's __init__ (and reads x from it): a
            # package-level cycle when that __init__ imports, in turn, the module asking.
            if base in modules and modules[base].name == "__init__.py" and me.startswith(base + "."):
                found.add(base)
        for name in names:
            # `import a.b.c` loads a.b.c; `from a.b import c` loads a.b.c when c is a module, else a.b
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me and not me.startswith(name + "."):
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_module_importing_its_own_packages_init_is_a_cycle_when_that_init_imports_it():
    """The check sees `from P import x` inside P: P's __init__ importing the module that does so
    is a cycle (as compiled/lora's was, through adapter.py's `from compiled.lora import layouts`)."""
    graph = {"p": {"p.a"}, "p.a": {"p"}, "p.b": set()}
    assert _cycle(graph) == ["p", "p.a", "p"]
    modules = _modules()
    found = _imports(ROOT / "compiled/lora/adapter.py", modules)
    assert "compiled.lora.layouts" in found and "compiled.lora" not in found


def _within(name: str, folders) -> bool:
    return any(name == f or name.startswith(f + ".") for f in folders)


def test_lower_folders_do_not_import_runtime_or_cli():
    bad = [f"{m} imports {i}" for m, deps in _graph().items() if _within(m, LOWER)
           for i in deps if _within(i, UPPER + ("compiled.compilation",))]
    assert not bad, bad


def test_compilation_does_not_import_runtime_or_cli():
    bad = [f"{m} imports {i}" for m, deps in _graph().items() if _within(m, ("compiled.compilation",))
           for i in deps if _within(i, UPPER)]
    assert not bad, bad


def test_op_folders_do_not_import_each_other():
    ops = ("compiled.attention", "compiled.moe", "compiled.linear")
    bad = [f"{m} imports {i}" for m, deps in _graph().items() for i in deps
           if any(_within(m, (a,)) and _within(i, ops) and not _within(i, (a,)) for a in ops)]
    assert not bad, bad


def test_every_folder_says_what_it_owns():
    for pkg in PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc, f"{init.relative_to(ROOT)} has no docstring"
            assert len(doc.strip().splitlines()) <= 2, f"{init.relative_to(ROOT)}: say it in two lines"


def test_readme_layout_matches_the_tree():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    section = section[:section.find("\n## ", 4) if "\n## " in section[4:] else len(section)]
    listed = set(re.findall(r"^\s*((?:compiled|cli)/[\w/]*?)/?\s", section, re.M))
    folders = {str(p.parent.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    folders.discard("compiled")  # the package root: its modules are listed one by one
    assert folders <= {f.rstrip("/") for f in listed}, f"not in the README's layout: {folders - listed}"
    assert {f.rstrip("/") for f in listed} <= folders, f"in the README but not the tree: {listed - folders}"


# Words that tell how the project was made rather than what it does.
MAKING = re.compile(r"\b(sessions?|rounds? of work|tickets?|issue \d+|#\d{2,}|sprints?|milestones?|"
                    r"device tool|lent|leases?d?|sandbox|agents?|claude|LLM-written|"
                    r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                    r"thirteenth|fourteenth|fifteenth|sixteenth) (session|run|round)|run \d+\b)", re.I)


def _tracked_text_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    for rel in out:
        path = ROOT / rel
        if not path.is_file() or path.suffix in (".safetensors", ".model", ".json") or rel.startswith(".ci/"):
            continue
        try:
            yield rel, path.read_text()
        except UnicodeDecodeError:
            continue


def test_no_words_about_the_making_of_the_project():
    hits = []
    for rel, text in _tracked_text_files():
        if rel == "tests/project/test_layout.py":
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if m := MAKING.search(line):
                hits.append(f"{rel}:{lineno}: {m.group(0)!r}")
    assert not hits, "\n".join(hits[:40]) + f"\n({len(hits)} in all)"


# RESULTS.md holds the current figures and one line per tuning decision: past this many lines it
# has become a diary (condense it, drop what the code no longer does).
RESULTS_MAX_LINES = 450


def test_results_are_current_and_short():
    lines = (ROOT / "bench" / "RESULTS.md").read_text().splitlines()
    assert len(lines) < RESULTS_MAX_LINES, f"bench/RESULTS.md has {len(lines)} lines"


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_no_function_outside_triton_kernels_runs_over_80_lines():
    """Functions a reader can hold at once: over 80 lines (decorators excluded) only for Triton
    kernels, whose bodies are one device program."""
    long = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 80:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def _reads_args_by_position(tree: ast.AST) -> list[int]:
    """Lines that index or slice a `.args` (`node.args[2]`, `moe.args[:5]`), unpack it into a
    starred expression (`*node.args`) or destructure it (`y, s = node.args`)."""
    def is_args(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "args"
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_args(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Starred) and is_args(node.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.For)) and is_args(node.value if isinstance(node, ast.Assign)
                                                                 else node.iter):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):
                lines.append(node.lineno)
    return sorted(lines)


def test_passes_read_op_calls_by_argument_name():
    """Only passes/calls.py reads a node's arguments by position; every pass goes through it, so an
    operand added to an op shifts no other silently."""
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "compiled" / "passes").glob("*.py"))
           if path.name != "calls.py" for line in _reads_args_by_position(ast.parse(path.read_text()))]
    assert not bad, "positional reads of node args (use compiled/passes/calls.py): " + ", ".join(bad)


def test_the_check_for_positional_reads_finds_them():
    code = "a = n.args[2]\nb = m.args[:5]\nf(*n.args)\ny, s, *_ = node.args\nok = len(n.args)\nn.args = (1,)\n"
    assert _reads_args_by_position(ast.parse(code)) == [1, 2, 3, 4]


# The LoRA primitives: ops of their own, which the family ops' LoRA operands are made of.
LORA_PRIMITIVES = {"lora_shrink", "lora_expand", "lora_token_slots"}


def test_no_op_is_a_lora_twin_of_another():
    """One op a family: LoRA enters an op as optional operands, never as a `*_lora` twin op (only
    the LoRA primitives carry the word); checked on every op that the modules registering ops
    register."""
    import importlib

    import torch
    for name, path in _modules().items():
        if "custom_op(" in path.read_text():
            importlib.import_module(name)
    names = {n.removeprefix("compiled::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("compiled::")}
    assert {"linear", "add_rms_norm_linear", "silu_mul_linear", "fused_moe", "moe_add_rms_norm_linear"} <= names
    twins = sorted(n for n in names if "lora" in n and n not in LORA_PRIMITIVES)
    assert not twins, f"LoRA twin ops: {twins}"
