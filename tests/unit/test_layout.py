"""The house's shape (STYLE.md): a short entry point, and no import that runs back up.

The import graph is read from the source with ``ast``, imports inside functions (the lazy ones)
and under ``if TYPE_CHECKING`` included: a cycle through a lazy import is still a loop a reader
has to untangle, and it becomes an import-time failure the day someone hoists the import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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


# ----------------------------------------------------------------------------- the top level (issue 41)

MAX_TOP_LEVEL_MODULES = 10


def top_level_modules(package: Path) -> list[str]:
    """The ``.py`` files directly in the package (its ``__init__`` and ``__main__`` count): the first thing a reader
    sees of the architecture; everything else belongs to a package that names its job."""
    return sorted(path.name for path in package.glob("*.py"))


def is_shim(source: str) -> bool:
    """A module that defines nothing and runs nothing: imports, ``__all__`` and a docstring only. Its importers
    should import what it re-exports from where that lives."""
    body = ast.parse(source).body
    inert = (ast.Import, ast.ImportFrom)
    return bool(body) and all(
        isinstance(node, inert)
        or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        or (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"])
        for node in body
    )


def command_modules(package: Path) -> dict[str, str]:
    """``python -m`` name -> module path, of every module outside ``bench/`` that runs as a command (a
    ``__main__.py``, or an ``if __name__ == "__main__":`` block)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if "bench" in parts:
            continue
        if '__name__ == "__main__"' in path.read_text():
            name = ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
            found[name] = str(path.relative_to(package.parent))
    return found


def test_the_top_level_holds_at_most_10_modules_and_no_shim() -> None:
    modules = top_level_modules(PACKAGE)
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, (
        f"ddptrain/ holds {len(modules)} modules {modules}: move each beside what uses it (a package per job)"
    )
    assert not [m for m in modules if m.startswith("checkpoint")], "the checkpoint code is one package: checkpoint/"
    shims = [name for name, source in package_sources().items() if is_shim(source) and "__init__" not in name]
    assert not shims, f"modules that only re-export: {shims}: import from where the names live, delete these"


def test_every_command_is_a_verb_of_the_ddptrain_command() -> None:
    """The command entry points in one place: ``ddptrain/cli.py``'s verbs. Every ``python -m ddptrain.X`` is one of
    them, each verb's module has its ``main``, and no other module builds an argument parser of its own."""
    from ddptrain.cli import VERBS

    commands = command_modules(PACKAGE)
    assert set(commands) == {"ddptrain"} | {verb.python_m for verb in VERBS.values()}, commands
    for name, verb in VERBS.items():
        module_source = (PACKAGE.parent / (verb.module.replace(".", "/") + ".py")).read_text()
        assert f"def {verb.function}(" in module_source, f"verb {name}: {verb.module} has no {verb.function}()"
    parsers = [name for name, source in package_sources().items() if "argparse.ArgumentParser(" in source]
    assert parsers == ["ddptrain/cli.py"], f"build parsers with ddptrain.cli.verb_parser, not in {parsers}"


def test_the_top_level_rules_see_a_crowded_top_level_a_shim_and_a_stray_command(tmp_path: Path) -> None:
    for name in ("__init__", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j"):
        (tmp_path / f"{name}.py").write_text("")
    assert len(top_level_modules(tmp_path)) == 11
    assert is_shim('"""Moved."""\nfrom x.y import Start\n\n__all__ = ["Start"]\n')
    assert not is_shim('from x import main\n\nif __name__ == "__main__":\n    main()\n')
    assert not is_shim("import x\n\n\ndef f():\n    pass\n")
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "__main__.py").write_text('if __name__ == "__main__":\n    pass\n')
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text('if __name__ == "__main__":\n    pass\n')
    assert command_modules(tmp_path) == {f"{tmp_path.name}.tool": f"{tmp_path.name}/tool/__main__.py"}


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
    ``<anything>["data"]`` and ``getattr(<anything>, "data")``, however the config object is named. Handing the
    group whole to a call (``build_training_data(cfg.data, ...)``) is how its own module gets it: not a read."""
    tree = ast.parse(source)
    handed_on = {id(arg) for call in ast.walk(tree) if isinstance(call, ast.Call) for arg in call.args}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == group and id(node) not in handed_on:
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
    assert group_reads("data = build_training_data(cfg.data, seed=1)\n", "data") == []
    assert group_reads("data = build_training_data(cfg.data.path)\n", "data") == [1]


def test_the_data_side_reads_only_the_data_group() -> None:
    """data.build_training_data gets the data group; what other groups decide arrives as arguments."""
    for path in sorted((PACKAGE / "data").glob("*.py")):
        source = path.read_text()
        for group in ("model", "optim", "parallel", "trainer"):
            reads = group_reads(source, group)
            assert reads == [], f"data/{path.name} reads the {group} group (lines {reads}): take it as an argument"


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


# ----------------------------------------------------------------------------- sizes (issue 22)

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
# Modules still over MAX_MODULE_LINES, each with the reason it may be for now. Remove an entry when its module is
# split (the rule then says so).
OVERSIZED_FOR_NOW: dict[str, str] = {}


def package_sources() -> dict[str, str]:
    """Every module of the package but the benchmarks (``bench/``: one command per benchmark, sized as it needs)."""
    return {
        str(path.relative_to(PACKAGE.parent)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if "bench" not in path.relative_to(PACKAGE).parts
    }


def oversized_module(source: str, limit: int = MAX_MODULE_LINES) -> int | None:
    """The module's line count when it is over ``limit``, else None."""
    lines = len(source.splitlines())
    return lines if lines > limit else None


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of each function or method longer than ``limit`` lines, ``def`` to its last line."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_module_is_over_500_lines() -> None:
    """STYLE.md: a module is one job, small enough to read at once."""
    found = {name: n for name, source in package_sources().items() if (n := oversized_module(source))}
    over = {name: n for name, n in found.items() if name not in OVERSIZED_FOR_NOW}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {over}"
    split = sorted(set(OVERSIZED_FOR_NOW) - set(found))
    assert not split, f"no longer over {MAX_MODULE_LINES} lines: remove them from OVERSIZED_FOR_NOW: {split}"


def test_no_function_is_over_60_lines() -> None:
    """STYLE.md: fit() about 60 lines, train_step() about 40; nothing outside bench/ longer than 60."""
    found = {name: hits for name, source in package_sources().items() if (hits := long_functions(source))}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_size_rules_see_a_long_module_and_a_long_function() -> None:
    assert oversized_module("x = 1\n" * 501) == 501
    assert oversized_module("x = 1\n" * 500) is None
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert long_functions(f"def f():\n{body}") == [("f", 61)]
    method = "class C:\n    def m(self):\n" + "".join(f"        x{i} = {i}\n" for i in range(60))
    assert long_functions(method) == [("m", 61)]
    assert long_functions("def f():\n" + body.rsplit("    x59", 1)[0]) == []


# ----------------------------------------------------------------------------- the config check stays fast

HEAVY = ("torch", "transformers", "datasets", "peft")


def module_level_imports(source: str) -> set[str]:
    """Top-level package names a module imports when it is imported: module-level statements only (also under
    ``if``/``try`` at module level), not inside functions, and not under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(source).body)
    return found


def test_the_config_package_imports_no_torch_at_module_level() -> None:
    """The config check must not load torch (seconds): a typo fails in well under a second (issue 22)."""
    for path in sorted((PACKAGE / "config").glob("*.py")):
        heavy = module_level_imports(path.read_text()) & set(HEAVY)
        assert not heavy, f"ddptrain/config/{path.name} imports {heavy} at module level: import it where needed"


def test_importing_the_config_loads_none_of_the_heavy_libraries() -> None:
    """What the AST check cannot see: a module the config imports that imports torch in turn."""
    code = f"import sys, ddptrain.config; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", f"importing ddptrain.config loads {out.stdout.strip()}"


def test_the_import_check_sees_a_module_level_torch() -> None:
    assert module_level_imports("import torch.nn as nn\nfrom datasets import x\n") == {"torch", "datasets"}
    assert module_level_imports("try:\n    import torch\nexcept ImportError:\n    pass\n") == {"torch"}
    assert module_level_imports("def f():\n    import torch\n") == set()
    assert module_level_imports("if TYPE_CHECKING:\n    import torch\n") == set()
