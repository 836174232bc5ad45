"""The house's shape (STYLE.md): a short entry point, and no import that runs back up.

The import graph is read from the source with ``ast``, imports inside functions (the lazy ones)
and under ``if TYPE_CHECKING`` included: a cycle through a lazy import is still a loop a reader
has to untangle, and it becomes an import-time failure the day someone hoists the import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddptrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, importer: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` that ``source`` (the text of module ``importer``) imports, anywhere in it."""
    package = importer if is_package else importer.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from pkg import name``: name is a submodule, or something defined in pkg itself.
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in candidates:
            while name and name not in known:  # ``import a.b.c``: the nearest module that exists
                name = name.rpartition(".")[0]
            if name and name != importer:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(files)
    return {
        name: imported_modules(path.read_text(), name, known, path.name == "__init__.py")
        for name, path in files.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path around each loop: the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_entry_point_is_at_most_40_lines() -> None:
    lines = (PACKAGE / "__main__.py").read_text().splitlines()
    assert len(lines) <= 40, f"ddptrain/__main__.py has {len(lines)} lines: move what is not composition to launch.py"


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    assert "ddptrain.parallel" in graph["ddptrain.launch"], "the graph misses a lazy import"
    assert cycles(graph) == [], "modules that import each other, directly or around a loop"


def test_the_cycle_check_sees_a_loop_through_a_lazy_import() -> None:
    known = {"ddptrain", "ddptrain.a", "ddptrain.b", "ddptrain.c"}
    graph = {
        "ddptrain.a": imported_modules("from ddptrain import b\n", "ddptrain.a", known),
        "ddptrain.b": imported_modules("import ddptrain.c.x\n", "ddptrain.b", known),
        "ddptrain.c": imported_modules("def f():\n    from .a import thing\n", "ddptrain.c", known),
    }
    assert cycles(graph) == [["ddptrain.a", "ddptrain.b", "ddptrain.c"]]
    graph["ddptrain.c"] = set()
    assert cycles(graph) == []


def group_reads(source: str, group: str) -> list[int]:
    """Lines where ``source`` reaches into a config's ``group``: ``<anything>.data`` but ``self.data``,
    ``<anything>["data"]`` and ``getattr(<anything>, "data")``, however the config object is named."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == group:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == group:
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr":
            lines += [node.lineno for a in node.args if isinstance(a, ast.Constant) and a.value == group]
    return lines


def test_the_trainer_only_trains() -> None:
    """STYLE.md: the trainer composes; the data side owns every data.* key (issue 10)."""
    source = (PACKAGE / "trainer.py").read_text()
    # 250 until issue 20/21 added four one-line calls (precision, attention advice, per-rank RNG, the save timeout).
    assert len(source.splitlines()) <= 260, "ddptrain/trainer.py grew past 260 lines: move what is not the loop out"
    assert group_reads(source, "data") == [], "trainer.py reads the data group: pass values in from data.py instead"


def test_the_group_read_check_sees_aliases() -> None:
    assert group_reads("x = cfg.data.batching\n", "data") == [1]
    assert group_reads("d = self.cfg.data\n", "data") == [1]
    assert group_reads("d = getattr(run_cfg, 'data')\n", "data") == [1]
    assert group_reads("d = run.data\nd = c['data']\n", "data") == [1, 2]
    assert group_reads("n = len(self.data.train)\n", "data") == []


def test_the_data_side_reads_only_the_data_group() -> None:
    """data.build_training_data gets the run config; what other groups decide arrives as arguments."""
    source = (PACKAGE / "data.py").read_text()
    for group in ("model", "optim", "parallel", "trainer"):
        assert group_reads(source, group) == [], f"data.py reads the {group} group: take the value as an argument"


def test_every_name_parallel_offers_has_a_caller_in_the_package() -> None:
    """ddptrain/parallel/ is the one door to torch.distributed: a name in it that nothing calls is a door nobody
    tests through (the trainer saves from the loss module it holds, not through an unwrapping helper)."""
    inside = sorted((PACKAGE / "parallel").glob("*.py"))
    source = "\n".join(p.read_text() for p in inside)
    offered = [
        node.name
        for p in inside
        for node in ast.parse(p.read_text()).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_")
    ]
    words = re.compile(r"\w+")
    used_elsewhere = {w for p in PACKAGE.rglob("*.py") if p not in inside for w in words.findall(p.read_text())}
    used_inside = words.findall(source)
    unused = [name for name in offered if name not in used_elsewhere and used_inside.count(name) == 1]
    assert offered and not unused, f"defined in ddptrain/parallel/, called nowhere: {unused}"
