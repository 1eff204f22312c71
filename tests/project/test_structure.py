"""The package's shape: no runtime import cycle, no source file (Python or C) over 500 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "slipcache"
MAX_LINES = 500
# Files still being split; each entry goes as its file gets under the limit.
KNOWN_LONG: set[str] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """slipcache modules imported when the code runs (module level or inside functions), TYPE_CHECKING aside
    unless `type_checking`: then also those a type checker follows."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("slipcache"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slipcache"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in modules}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _runtime_imports(ast.parse(path.read_text()), modules, type_checking) - {name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse(
        "import typing\nif typing.TYPE_CHECKING:\n    import slipcache.x\ndef f():\n    import slipcache.y\n"
    )
    assert _runtime_imports(tree, {"slipcache.x": Path(), "slipcache.y": Path()}) == {"slipcache.y"}


def test_no_runtime_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_no_import_cycle_counting_type_checking_imports() -> None:
    assert cycles(import_graph(type_checking=True)) == []
    tree = ast.parse("import typing\nif typing.TYPE_CHECKING:\n    import slipcache.x\n")
    assert _runtime_imports(tree, {"slipcache.x": Path()}, type_checking=True) == {"slipcache.x"}


def test_no_module_imports_the_command_module() -> None:
    """`slipcache.cli` is the entry point only: shared flags and their types live in `slipcache.options`."""
    importers = sorted(name for name, imports in import_graph().items() if "slipcache.cli" in imports)
    assert importers == []


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name the code uses: variables, attributes, functions, arguments, keywords, imports."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name)
    return found


def test_the_training_loop_knows_no_feature() -> None:
    """Features join the loop through callbacks (`training/features.py`), and the backend answers which part
    of a batch this process reads: the loop names no feature and never asks the batches for their filter."""
    tree = ast.parse((PACKAGE / "training" / "trainer.py").read_text())
    named = {n for n in _identifiers(tree) if any(w in n.lower() for w in ("lookahead", "prefetch", "input_part"))}
    assert named == set()
    reads_filter = [
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "sample_filter"
        and not (isinstance(node.value, ast.Attribute) and node.value.attr == "callbacks")
        and not (isinstance(node.value, ast.Name) and node.value.id == "callbacks")
    ]  # fmt: skip
    assert reads_filter == []
    assert {"skipped_fraction", "staleness"}.isdisjoint(
        node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )
    caught = _identifiers(ast.parse("def f(batches):\n    return batches.peek(model.input_part)\n"))
    assert "input_part" in caught and "batches" in caught  # the finder sees attributes and arguments


def test_dependencies_point_down_to_the_loop() -> None:
    """The loop (`training`) uses the data, the tables and skipping; none of those imports the loop."""
    lower = ("slipcache.data", "slipcache.embedding", "slipcache.staleness")
    up = sorted(
        f"{name} -> {target}" for name, imports in import_graph().items() if name.startswith(lower)
        for target in imports if target.startswith("slipcache.training")
    )  # fmt: skip
    assert up == []


def test_training_does_not_import_distributed() -> None:
    """`distributed` builds on `training`; one process reads a checkpoint of N processes with torch's DCP
    alone (`training.step_checkpoint`), and `slipcache train` picks one process or N in `train_command.py`."""
    up = sorted(
        f"{name} -> {target}" for name, imports in import_graph().items() if name.startswith("slipcache.training")
        for target in imports if target.startswith("slipcache.distributed")
    )  # fmt: skip
    assert up == []


def _design_map() -> set[str]:
    """The source files docs/design.md's tables name: `a/b.py`, then `c.py` in the same cell means `a/c.py`."""
    named: set[str] = set()
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        names = re.findall(r"`([^`]+)`", line.split("|")[1]) if line.startswith("| `") else []
        base = names[0].rsplit("/", 1)[0] if names and "/" in names[0] else ""
        named.update(n if "/" in n or not base else f"{base}/{n}" for n in names)
    return {n for n in named if n.startswith("slipcache/")}


def test_the_design_map_names_every_source_file() -> None:
    named = _design_map()
    folders = tuple(n for n in named if n.endswith("/"))
    files = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert sorted(f for f in files if f not in named and not f.startswith(folders)) == []
    assert sorted(n for n in named if not (PACKAGE.parent / n).exists()) == []


def _choices(tree: ast.AST) -> set[str]:
    """Functions (`Class.method` for methods) that ask whether a compiled loop can run: `_native.usable`,
    `_native.native` or `quantize.available`."""
    found: set[str] = set()

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = f"{where}.{node.name}" if where else node.name
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and (node.func.value.id, node.func.attr) in {("_native", "usable"), ("_native", "native"),
                                                        ("quantize", "available")}
        ):
            found.add(where)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "")
    return found


def test_the_compiled_or_torch_choice_is_made_once_per_operation() -> None:
    """Each operation with a compiled loop chooses between it and its torch or NumPy reference in one function;
    callers call that function and never ask which ran."""
    asked = {
        f"{name}:{where}"
        for name, path in _modules().items()
        if not name.startswith("slipcache._native")
        for where in _choices(ast.parse(path.read_text()))
    }
    kernels = ["global_rows", "pool_bags", "distinct_rows", "missing_rows", "fill_misses", "sum_rows",
               "sum_rows_if_finite", "sgd_scatter", "sgd_scatter_if_finite", "adagrad_update", "all_finite"]
    assert asked == {
        *(f"slipcache.embedding.kernels:{name}" for name in kernels),
        "slipcache.embedding.cache:RowCache._compiled",  # its lookup, fused gather and slot assignment
        "slipcache.embedding.quant:RowStorage.read",  # the dequantize pass
        "slipcache.embedding.quant:RowStorage.read_into",  # the dequantize pass, into given rows (cache slots)
        "slipcache.embedding.quant:RowStorage._write_compiled",  # the quantize pass
        "slipcache.staleness.filtering:_compiled",  # classify and filter_inputs
        "slipcache.staleness.filtering:count_hot_lookups",
        "slipcache.bench.quantize:run_quantize_bench",  # compares the two paths: refused without the compiled one
    }
    assert _choices(ast.parse("class A:\n    def f(self):\n        return _native.usable(x)\n")) == {"A.f"}
