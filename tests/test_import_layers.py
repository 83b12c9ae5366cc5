"""memmode_core's modules depend on each other in one direction: no import cycle (not even through
``TYPE_CHECKING`` imports), and no import from a lower layer to a higher one.

The layers, bottom to top, one folder each, are those of ``tests/layers.py`` (documented in
``memmode_core/__init__.py``).

Every import counts — at module level or inside a function, and ``from memmode_core import X`` (an edge to
the package itself, which imports every layer) — except those under ``if TYPE_CHECKING:``, which never run
and so only count for cycles. Discovery loads the built-in plugins by module name, as it loads entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

from layers import LAYERS, layer_of

PACKAGE = Path(__file__).resolve().parent.parent / "memmode_core"


def module_names() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.AST, type_checking: bool = False):
    """Import nodes, skipping ``if TYPE_CHECKING:`` blocks (or including them, ``type_checking=True``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            branches = [*node.body, *node.orelse] if type_checking else node.orelse
            yield from (n for child in branches for n in _runtime_imports(child, type_checking))
            if type_checking:
                yield from (child for child in node.body if isinstance(child, (ast.Import, ast.ImportFrom)))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node, type_checking)


#: the package itself (``memmode_core/__init__.py``): ``from memmode_core import X`` and ``import memmode_core``
PACKAGE_MODULE = "__init__"


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports. ``from memmode_core import X`` is an edge to the package itself
    (``__init__``), or to the module ``X`` when ``X`` is one; ``type_checking=True`` adds the imports under
    ``if TYPE_CHECKING:``, which never run but still tie the two modules together."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        if name == PACKAGE_MODULE:
            package = ""
        for node in _runtime_imports(ast.parse(path.read_text()), type_checking):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    origin = ".".join([*base, *([node.module] if node.module else [])])
                elif node.module == "memmode_core" or (node.module or "").startswith("memmode_core."):
                    origin = node.module[len("memmode_core") :].lstrip(".")
                else:
                    continue
                for alias in node.names:
                    candidate = f"{origin}.{alias.name}".lstrip(".")
                    target = candidate if candidate in modules else (origin or PACKAGE_MODULE)
                    if target in modules and target != name:
                        graph[name].add(target)
            else:
                for alias in node.names:
                    if alias.name == "memmode_core":
                        target = PACKAGE_MODULE
                    elif alias.name.startswith("memmode_core."):
                        target = alias.name[len("memmode_core.") :]
                    else:
                        continue
                    if target in modules and target != name:
                        graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_of_memmode_core_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(f"memmode_core.{m}" if m else "memmode_core" for m in cycle)


def test_no_cycle_even_through_type_checking_imports():
    """An import under ``if TYPE_CHECKING:`` never runs, but a cycle through one still means two modules that
    each need the other: the contract and the mechanics must not know each other both ways."""
    cycle = find_cycle(import_graph(type_checking=True))
    assert cycle is None, "import cycle (through TYPE_CHECKING imports): " + " -> ".join(
        f"memmode_core.{m}" if m else "memmode_core" for m in cycle
    )


def test_imports_only_point_down_the_layers():
    upward = [
        (module, target)
        for module, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(module)
    ]
    assert upward == [], "imports from a lower layer to a higher one: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_the_check_sees_imports_inside_functions():
    """The checker itself: a function-level import is an edge (that is how cycles used to hide)."""
    tree = ast.parse("def f():\n    from .planner import plan\nif TYPE_CHECKING:\n    from .api import Handle\n")
    found = [ast.unparse(n) for n in _runtime_imports(tree)]
    assert found == ["from .planner import plan"]
    found = [ast.unparse(n) for n in _runtime_imports(tree, type_checking=True)]
    assert sorted(found) == ["from .api import Handle", "from .planner import plan"]


def test_the_check_sees_imports_of_the_package_itself():
    """The checker itself: ``from memmode_core import X`` inside the package is an edge to the package (its
    ``__init__`` imports every layer, so a module below the top must not), or to ``X`` when it is a module."""
    graph = import_graph()
    assert all(PACKAGE_MODULE not in targets for module, targets in graph.items() if layer_of(module) < 5)
    tree = ast.parse("from memmode_core import apply\nfrom memmode_core import engine\nimport memmode_core\n")
    assert len(list(_runtime_imports(tree))) == 3


def test_the_folders_are_the_layers():
    """Every module below the top layer lives in its layer's folder: the tree shows the layering."""
    for name, path in module_names().items():
        if path.parent == PACKAGE and path.stem not in ("__init__", "__main__"):
            assert layer_of(name) == len(LAYERS) - 1, (
                f"memmode_core/{path.name} is a top-level file outside the top layer"
            )
        else:
            top = name.split(".")[0]
            assert layer_of(name) == layer_of(top), f"memmode_core.{name} is not in its folder's layer"


#: where memmode may name ``torch.cuda``: only what is CUDA-only by nature (``cudaHostRegister`` slabs); every
#: other stream, event, copy and memory call goes through ``memmode_core/engine/streams.py``
#: the one CUDA-only call has no device-generic form: page-locking memory in place (``cudaHostRegister``), in the
#: stream layer, where the strict model replaces it
CUDA_ONLY = {"memmode_core/engine/streams.py"}


def _uses_torch_cuda(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and ast.unparse(node.value) == "torch"
    ]


def test_only_the_stream_layer_speaks_to_the_accelerator():
    """No ``torch.cuda`` in memmode_core or the plugins outside the stream layer's page-locking in place: the rest
    is device-generic,
    and the strict model of asynchronous copies, which replaces the stream layer, sees every call."""
    root = PACKAGE.parent
    found = {}
    for path in [*PACKAGE.rglob("*.py"), *(root / "plugins").glob("*/*/*.py")]:
        lines = _uses_torch_cuda(ast.parse(path.read_text()))
        relative = path.relative_to(root).as_posix()
        if lines and relative not in CUDA_ONLY:
            found[relative] = lines
    assert not found, f"torch.cuda outside the stream layer: {found}"
    assert all(_uses_torch_cuda(ast.parse((root / p).read_text())) for p in CUDA_ONLY), "stale CUDA_ONLY entry"


#: the most lines a module of memmode_core or of a plugin may have: past it, a module has grown more jobs than
#: its name can say (the five that passed 500 lines each mixed five to seven); split it by job
MODULE_LINES = 450


def test_no_module_is_longer_than_one_job_needs():
    root = PACKAGE.parent
    long = {
        path.relative_to(root).as_posix(): lines
        for path in [*PACKAGE.rglob("*.py"), *(root / "plugins").glob("*/*/*.py")]
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines (split them by job): {long}"
