"""The package's layers: every import inside ``fairseq_plugins`` points downward, and none closes a circle.

Layers, innermost first (``LAYERS``): a module may import from its own layer and the ones
before it. Inside ``modules/`` a model family's subpackage may import only ``modules.common``
besides itself. Imports are read from the source (including those inside functions and under
``TYPE_CHECKING``), so a lazy import is held to the same rule.
"""

import ast
from pathlib import Path
from typing import Dict, Set
from tests.cli import REPO

PACKAGE = REPO / "fairseq_plugins"
LAYERS = [
    "__init__",  # the package itself: imports nothing of its own
    "resources",  # where the package's files and caches are, and how this copy was installed
    "command_line",  # what every console command's parser shares (--version, plain help)
    "fairseq_fixes",  # repairs the installed fairseq
    "fairseq_build",  # builds and installs fairseq with those fixes
    "registration",  # what models/ and tasks/ run first: the fixes checked, every module imported
    "graphs",  # graph types and builders, pure torch
    "graph_attention",  # the op, its registry and one module per backend
    "data",  # datasets
    "modules",  # one subpackage per model family, over ``modules.common``
    "models",  # fairseq registration
    "tasks",  # fairseq tasks
    "recipes",  # commands that reproduce the papers: data, configs, training, evaluation, demo
    "check_gpu",  # a command (python -m fairseq_plugins.check_gpu): runs the GPU checks
]
SHARED_FAMILY = "common"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The package modules that ``name`` imports (absolute and relative)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known)
    found.discard(name)
    return found


def layer_of(name: str) -> int:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYERS, f"{name}: its layer is not listed in tests/project/test_layers.py LAYERS"
    return LAYERS.index(top)


def family_of(name: str):
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "modules" else None


def import_graph() -> Dict[str, Set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_imports_point_downward():
    wrong = []
    for name, targets in import_graph().items():
        for target in targets:
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name} imports {target} from a layer above it")
            family, other = family_of(name), family_of(target)
            if family and other and other not in (family, SHARED_FAMILY):
                wrong.append(f"{name} (family {family}) imports {target} (family {other})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = import_graph()
    state: Dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name, path):
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_checker_sees_violations(tmp_path, monkeypatch):
    """The rules above catch an upward import and a circle (checked on a throw-away package)."""
    package = tmp_path / "fairseq_plugins"
    for sub in ("graphs", "models", "modules/bpt", "modules/slowfast"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "graphs" / "a.py").write_text("from fairseq_plugins.models import b\n")
    (package / "models" / "b.py").write_text("from ..graphs import a\n")
    (package / "modules" / "bpt" / "c.py").write_text("from fairseq_plugins.modules.slowfast import d\n")
    (package / "modules" / "slowfast" / "d.py").write_text("")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    try:
        test_imports_point_downward()
    except AssertionError as error:
        message = str(error)
    else:
        raise AssertionError("an upward import passed")
    assert "fairseq_plugins.graphs.a imports fairseq_plugins.models.b from a layer above it" in message
    assert "family bpt" in message
    try:
        test_no_import_circle()
    except AssertionError as error:
        assert "import circle" in str(error)
    else:
        raise AssertionError("a circle passed")


def test_former_public_import_path_still_works():
    """``fairseq_plugins.modules.graph_attention`` was the documented path before the layers."""
    from fairseq_plugins.graph_attention import AttentionGraph, graph_attention
    from fairseq_plugins.modules.graph_attention import AttentionGraph as OldGraph
    from fairseq_plugins.modules.graph_attention import graph_attention as old_op

    assert old_op is graph_attention and OldGraph is AttentionGraph
