"""The shape of memmode_core's classes and modules, checked on their source (``ast``), beside the import layers of
``tests/test_import_layers.py``. Each rule keeps a module's state its own, so that a newcomer can read one
module and know who touches what it holds:

- **one base of ours** — a class has at most one base class defined in memmode_core (or in its own plugin):
  two of ours are mixins sharing ``self``'s state, each reading what the other sets;
- **privates stay home** — ``x._name`` (not a dunder), ``getattr``/``setattr``/``hasattr``/``delattr`` with a
  literal ``"_name"``, and ``from memmode_core.m import _name`` name a private of the module that reads it:
  ``_name`` is defined in that same module (a ``def``/``class``, a class attribute or dataclass field,
  ``self._name = ...``, a module-level name). ``self._name`` counts too: a subclass reading its base's private
  in another module is the same coupling as a mixin's. A private of torch, of the standard library or of
  another third-party library is named in :data:`THIRD_PARTY_PRIVATES`, with why we touch it;
- **no** ``locals()`` **as an argument** — what a function passes on is spelled out, not its whole frame;
- **one name, one class** — no two classes of memmode_core share a name (nested ones included): a name a reader
  meets means one thing;
- **one stage makes packed layers** — ``attach_packed`` and ``install_forward`` are called from
  ``quantization/making.py`` alone, which three roads feed (packing in memory, packing while streaming, the
  placeholders every source of weights gets from one function): a new format adds no place that makes a layer.

Run this file (``python tests/test_structure.py [out.txt]``) to list every violation, one ``file:line: what``.
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memmode_core"

#: torch's, the standard library's and other libraries' privates that memmode must touch: their internals, not
#: our modules'. Matched by name, so an entry also excuses a private of ours of the same name (two today:
#: ``_buffers`` in testing/strict_streams.py and in the disk storage); never add a name that is only ours.
THIRD_PARTY_PRIVATES = {
    # torch.nn.Module's own tables: loading, packing and the engine swap a module's tensors in place, and
    # ``named_parameters``/``named_buffers`` would copy the mapping and skip the tied duplicates
    "_parameters": "torch.nn.Module's parameter table, read and written in place",
    "_buffers": "torch.nn.Module's buffer table, read and written in place",
    "_non_persistent_buffers_set": "torch.nn.Module: the buffers a state dict leaves out (saving mirrors it)",
    # torch internals with no public spelling
    "_C": "torch._C.DisableTorchFunctionSubclass: a stand-in's own code sees plain tensors",
    "_select_conv_backend": "torch._C._select_conv_backend: which convolution kernel, for its workspace",
    "_dynamo": "torch._dynamo.eval_frame.OptimizedModule: what torch.compile returns, refused by apply",
    "_orig_mod": "the module torch.compile's OptimizedModule wraps",
    "_compiled_call_impl": "set by nn.Module.compile(): a module compiled in place",
    "_cdata": "an untyped storage's C pointer: which tensors share memory, for live bytes",
    "_schema": "an aten OpOverload's schema: which outputs alias an input, for live bytes",
    "_scaled_dot_product_flash_attention_for_cpu": "an aten op (its public name starts with _), priced by the planner",
    "_pytree": "torch.utils._pytree: flattening a call's nested inputs and outputs as torch does",
    "_disable_current_modes": "torch.utils._python_dispatch: leaving a dispatch mode to make a real tensor",
    "_get_default_store": "torch.distributed's store: the ranks of a node agree on one group file",
    "_version": "a tensor's version counter: diffusers' conversion passed a file's tensor on unwritten",
    # diffusers' and transformers' class attributes: what a model or pipeline declares about itself
    "_cp_plan": "diffusers: a transformer's context-parallel plan (it can be split over ranks)",
    "_diffusers_hook": "diffusers' HookRegistry on a module: its own group offloading, refused beside ours",
    "_exclude_from_cpu_offload": "diffusers: components a pipeline keeps on the device",
    "_group_offload_block_modules": "diffusers: a model's blocks for group offloading",
    "_supports_group_offloading": "diffusers: whether a model can be group-offloaded",
    "_keep_in_fp32_modules": "diffusers/transformers: modules a model keeps in float32",
    "_no_split_modules": "diffusers/transformers: a model's blocks (layers to keep whole)",
    "_repeated_blocks": "diffusers: a model's repeated blocks",
    "_optional_components": "diffusers: a pipeline's components that may be None",
    "_from_config": "transformers: build a model from its config with a dtype (the public from_config has none)",
    # the standard library
    "_fields": "collections.namedtuple's public field names (spelled with one underscore)",
    "_getframe": "sys._getframe: the caller's frame, named by an error about a read",
    "_normalized_name": "importlib.metadata.PathDistribution: a distribution's name without parsing metadata",
    "_run_exitfuncs": "atexit: a rank forked by multiprocessing ends in os._exit, so it runs the exit functions itself",
}


def sources() -> list[Path]:
    """memmode_core's modules and the first-party plugins' packages (``plugins/<dist>/<package>/*.py``)."""
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "plugins").glob("*/*/*.py")])


def package_of(path: Path) -> str:
    """The top-level package a source belongs to: ``memmode_core`` or a plugin's (``memmode_qfloat8``)."""
    relative = path.relative_to(ROOT).parts
    return relative[0] if relative[0] == "memmode_core" else relative[2]


def dotted(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("").parts
    parts = relative if relative[0] == "memmode_core" else relative[2:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass(frozen=True, order=True)
class Violation:
    where: str
    line: int
    rule: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: [{self.rule}] {self.what}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _is_self(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: the object whose class this code is (part of)."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


_ATTRIBUTE_FUNCTIONS = {"getattr": "read", "hasattr": "read", "setattr": "write", "delattr": "write"}


def _named_attribute(node: ast.Call) -> tuple[ast.AST, str, str] | None:
    """``getattr(obj, "_x")`` and kin, ``object.__setattr__(obj, "_x", v)``: (obj, the name, read/write)."""
    func, args = node.func, node.args
    if isinstance(func, ast.Name) and func.id in _ATTRIBUTE_FUNCTIONS:
        kind = _ATTRIBUTE_FUNCTIONS[func.id]
    elif isinstance(func, ast.Attribute) and func.attr == "__setattr__" and ast.unparse(func.value) == "object":
        kind = "write"
    else:
        return None
    if len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
        return args[0], args[1].value, kind
    return None


def definitions(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names a module defines: (strong, weak). Strong: a ``def``/``class``, a name bound at module level or
    in a class body (attributes, dataclass fields), an import, ``self.x = ...``/``setattr(self, "x", ...)``,
    a module-level string constant (the attribute name it spells). Not a member a ``Protocol`` declares.
    Weak: ``obj.x = ...`` on any other object — our attribute on a foreign object (torch's module, a tensor)
    unless another module defines ``x`` strongly, when it is a write into that module's private state."""
    strong, weak = set(), set()

    def bind(target: ast.AST, scope_binds: bool) -> None:
        if isinstance(target, ast.Name) and scope_binds:
            strong.add(target.id)
        elif isinstance(target, ast.Attribute):
            (strong if _is_self(target.value) else weak).add(target.attr)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                bind(element, scope_binds)
        elif isinstance(target, ast.Starred):
            bind(target.value, scope_binds)

    def visit(node: ast.AST, scope_binds: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and any(ast.unparse(b).endswith("Protocol") for b in child.bases):
                continue  # an interface: a private it declares is another module's, reached through it
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                strong.add(child.name)
            if isinstance(child, ast.Assign):
                for target in child.targets:
                    bind(target, scope_binds)
                if node is tree and isinstance(child.value, ast.Constant) and isinstance(child.value.value, str):
                    strong.add(child.value.value)  # ``PACKED_ATTRIBUTE = "_memmode_packed"``: the module's name
            elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                bind(child.target, scope_binds)
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and scope_binds:
                # a private imported stays the other module's (the import itself is a violation)
                strong.update((a.asname or a.name).split(".")[0] for a in child.names if not is_private(a.name))
            elif isinstance(child, ast.Call) and (named := _named_attribute(child)) and named[2] == "write":
                (strong if _is_self(named[0]) else weak).add(named[1])
            inner = isinstance(child, ast.ClassDef) or (scope_binds and not isinstance(child, _FUNCTIONS))
            visit(child, inner)

    visit(tree, True)
    return strong, weak


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _imported_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_accesses(
    tree: ast.AST, where: str, module: str, is_package: bool, ours: set[str], elsewhere: dict[str, set[str]]
) -> list[Violation]:
    """Rule b for one module: each private name it touches must be its own (see the module docstring).
    ``ours``: the top-level packages whose privates count (memmode_core, the plugins); ``elsewhere``: private
    name -> the other modules that define it strongly."""
    strong, weak = definitions(tree)
    own = strong | {name for name in weak if not elsewhere.get(name)}
    found = []

    def touch(node: ast.AST, obj: ast.AST, name: str, how: str) -> None:
        if is_private(name) and name not in own and name not in THIRD_PARTY_PRIVATES:
            whose = f" (defined in {', '.join(sorted(elsewhere[name]))})" if elsewhere.get(name) else ""
            found.append(Violation(where, node.lineno, "private", f"{how} {ast.unparse(obj)}.{name}{whose}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            touch(node, node.value, node.attr, "writes" if isinstance(node.ctx, (ast.Store, ast.Del)) else "reads")
        elif isinstance(node, ast.Call) and (named := _named_attribute(node)):
            touch(node, named[0], named[1], f"{ast.unparse(node.func)}() of")
        elif isinstance(node, ast.ImportFrom):
            origin = _imported_from(node, module, is_package)
            for alias in node.names:
                if is_private(alias.name) and (origin.split(".")[0] in ours or alias.name not in THIRD_PARTY_PRIVATES):
                    found.append(Violation(where, node.lineno, "private", f"imports {origin}'s private {alias.name}"))
    return found


def _base_names(tree: ast.AST, module: str, is_package: bool, ours: set[str]) -> dict[str, str]:
    """Local name -> where it comes from, for every class defined in the module and every name imported from
    one of ``ours`` (a module alias too: ``_layout.GroupSpec`` resolves through it)."""
    names = {node.name: module for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            origin = _imported_from(node, module, is_package)
            if origin.split(".")[0] in ours:
                names.update({alias.asname or alias.name: origin for alias in node.names})
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ours:
                    names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


def our_bases(tree: ast.AST, where: str, module: str, is_package: bool, ours: set[str]) -> list[Violation]:
    """Rule a for one module: classes with two or more bases defined in ``ours``."""
    local = _base_names(tree, module, is_package, ours)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        mine = []
        for base in node.bases:
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in local:
                mine.append(ast.unparse(base))
        if len(mine) > 1:
            found.append(
                Violation(where, node.lineno, "bases", f"class {node.name} has {len(mine)} bases of ours: {mine}")
            )
    return found


def locals_passed(tree: ast.AST, where: str) -> list[Violation]:
    """Rule c for one module: ``locals()`` given to a call, positionally or as ``**locals()``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
                inner = argument.value if isinstance(argument, ast.Starred) else argument
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "locals":
                    found.append(
                        Violation(where, node.lineno, "locals", f"passes locals() to {ast.unparse(node.func)}")
                    )
    return found


def check(files: dict[str, str]) -> list[Violation]:
    """Every violation of the three rules in ``files``: path (relative to the repository, as
    ``memmode_core/engine/moving.py`` or ``plugins/<dist>/<package>/x.py``) -> source."""
    parsed = {}
    for where, text in files.items():
        path = ROOT / where
        parsed[where] = (ast.parse(text), dotted(path), path.name == "__init__.py", package_of(path))
    ours = {package for *_, package in parsed.values()}
    strong = {where: definitions(tree)[0] for where, (tree, *_) in parsed.items()}
    found = []
    for where, (tree, module, is_package, _) in parsed.items():
        elsewhere: dict[str, set[str]] = {}
        for other, names in strong.items():
            if other != where:
                for name in names:
                    if is_private(name):
                        elsewhere.setdefault(name, set()).add(other)
        found += private_accesses(tree, where, module, is_package, ours, elsewhere)
        found += our_bases(tree, where, module, is_package, ours)
        found += locals_passed(tree, where)
    return sorted(found)


@functools.cache
def violations() -> list[Violation]:
    return check({path.relative_to(ROOT).as_posix(): path.read_text() for path in sources()})


def test_no_class_has_two_bases_of_ours():
    found = [v for v in violations() if v.rule == "bases"]
    assert not found, "mixins sharing state:\n" + "\n".join(map(str, found))


def test_no_module_touches_another_modules_privates():
    found = [v for v in violations() if v.rule == "private"]
    assert not found, "privates touched outside their module:\n" + "\n".join(map(str, found))


def test_no_locals_passed_as_an_argument():
    found = [v for v in violations() if v.rule == "locals"]
    assert not found, "locals() passed on:\n" + "\n".join(map(str, found))


def test_every_third_party_private_is_still_touched():
    """A stale entry would excuse a private of ours that later takes the same name."""
    touched = set()
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                touched.add(node.attr)
            elif isinstance(node, ast.Call) and (named := _named_attribute(node)):
                touched.add(named[1])
            elif isinstance(node, ast.ImportFrom):
                touched.update(alias.name for alias in node.names)
    assert set(THIRD_PARTY_PRIVATES) <= touched, f"stale: {sorted(set(THIRD_PARTY_PRIVATES) - touched)}"


# -- the checks themselves, on synthetic modules: each one can fail --

_A = "memmode_core/engine/a.py"
_B = "memmode_core/engine/b.py"


def test_the_check_sees_two_bases_of_ours():
    files = {
        _A: "class Moving:\n    pass\nclass Changes:\n    pass\n",
        _B: "import torch\nfrom memmode_core.engine.a import Moving\nfrom memmode_core.engine import a as _a\n"
        "class Runtime(Moving, _a.Changes):\n    pass\nclass Fine(Moving, torch.nn.Module):\n    pass\n",
    }
    assert [(v.where, v.line, v.rule) for v in check(files)] == [(_B, 4, "bases")]


def test_the_check_sees_privates_of_another_module():
    files = {
        _A: "class Ledger:\n    def __init__(self):\n        self._rows = []\n    def _add(self, row):\n"
        "        self._rows.append(row)\n_TABLE = {}\n",
        _B: "from memmode_core.engine.a import _TABLE\nfrom memmode_core.engine import a\n"
        "def f(ledger, module):\n    ledger._rows.append(1)\n    a._TABLE.clear()\n"
        "    getattr(ledger, '_rows')\n    setattr(ledger, '_rows', [])\n"
        "    module._parameters.clear()\n    module._memmode_seen = True\n    return module._memmode_seen\n"
        "class Sub(a.Ledger):\n    def g(self):\n        self._add(1)\n",
    }
    found = [(v.line, v.what.split(" (")[0]) for v in check(files)]
    assert found == [
        (1, "imports memmode_core.engine.a's private _TABLE"),
        (4, "reads ledger._rows"),
        (5, "reads a._TABLE"),
        (6, "getattr() of ledger._rows"),
        (7, "setattr() of ledger._rows"),
        (13, "reads self._add"),
    ]


def test_the_check_sees_writes_into_another_modules_private():
    files = {_A: "class Ledger:\n    _rows = ()\n", _B: "def f(ledger):\n    ledger._rows = [1]\n"}
    assert [(v.where, v.line) for v in check(files)] == [(_B, 2)]


def test_the_check_knows_what_a_module_names_and_what_an_interface_declares():
    """A module-level ``"_name"`` constant makes ``_name`` its module's; a ``Protocol`` declaring ``_name`` does
    not make it the declaring module's; a third-party private import is excused only by the allow-list."""
    files = {
        _A: 'PACKED = "_memmode_packed"\nclass Model:\n    def _stack(self):\n        return []\n',
        _B: "from typing import Protocol\nfrom torch.utils import _pytree\nfrom torch.utils import _secret\n"
        "class Needs(Protocol):\n    def _stack(self): ...\n"
        "def f(layer, model: Needs):\n    model._stack()\n    return layer._memmode_packed\n",
    }
    found = [(v.where, v.line, v.what.split(" (")[0]) for v in check(files)]
    assert found == [
        (_B, 3, "imports torch.utils's private _secret"),
        (_B, 7, "reads model._stack"),
        (_B, 8, "reads layer._memmode_packed"),
    ]


def test_the_check_sees_locals_passed_on():
    files = {_A: "def f(a, b):\n    g(locals())\n    h(x=locals())\n    k(**locals())\n    return locals()\n"}
    assert [(v.line, v.rule) for v in check(files)] == [(2, "locals"), (3, "locals"), (4, "locals")]


# -- one meaning per name: a class name is defined once in memmode_core --


def class_definitions(files: dict[str, str]) -> dict[str, list[str]]:
    """Class name -> every ``file:line`` of ``files`` (path -> source) that defines a class of that name, at the top
    level of a module or nested in a class or a function."""
    found: dict[str, list[str]] = {}
    for where, text in sorted(files.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{where}:{node.lineno}")
    return found


def duplicate_classes(files: dict[str, str]) -> dict[str, list[str]]:
    """The class names ``files`` define more than once, each with where."""
    return {name: places for name, places in class_definitions(files).items() if len(places) > 1}


def test_no_class_name_is_defined_twice():
    """One name, one meaning: two classes called ``Slot`` (or ``Reader``, ``Source``) make every reader of either
    ask which one; each class of memmode_core has a name no other class of it has."""
    files = {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    found = duplicate_classes(files)
    assert not found, "class names defined more than once:\n" + "\n".join(
        f"{name}: {', '.join(places)}" for name, places in sorted(found.items())
    )


def test_the_check_sees_a_class_defined_twice():
    files = {
        _A: "class Slot:\n    pass\nclass Group:\n    class Part:\n        pass\n",
        _B: "def f():\n    class Part:\n        pass\nclass Slot:\n    pass\nclass Other:\n    pass\n",
    }
    assert duplicate_classes(files) == {"Part": [f"{_A}:4", f"{_B}:2"], "Slot": [f"{_A}:1", f"{_B}:4"]}


# -- one stage makes packed layers ------------------------------------------------------------------------------


def callers_of(name: str) -> set[tuple[str, str]]:
    """Every place in memmode_core and the plugins that calls a function called ``name`` (``f(...)`` or
    ``x.f(...)``): ``(file, enclosing function)``."""
    found = set()

    def visit(node: ast.AST, where: str, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                called = child.func
                called_name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)
                if called_name == name:
                    found.add((where, function))
            visit(child, where, inner)

    for path in sources():
        visit(ast.parse(path.read_text()), path.relative_to(ROOT).as_posix(), "<module>")
    return found


MAKING = "memmode_core/quantization/making.py"


def test_one_stage_makes_packed_layers_and_installs_their_forward():
    """A packed layer is made, and made to run, in ``quantization/making.py`` alone: ``attach_packed`` and
    ``install_forward`` are called nowhere else, and the stage is fed by three roads only — packing in memory,
    packing while streaming, and the placeholders of the layers a source of weights keeps packed (one function
    makes those, for every format)."""
    assert callers_of("attach_packed") == {(MAKING, "make_packed")}
    assert callers_of("install_forward") == {(MAKING, "make_packed"), (MAKING, "run_packed")}
    assert callers_of("make_packed") == {(MAKING, "make_selected"), (MAKING, "make_placeholders")}
    assert callers_of("make_selected") == {
        ("memmode_core/quantization/quantizing.py", "_pack_all"),
        ("memmode_core/quantization/streaming.py", "stream_pack"),
    }
    assert {where for where, _ in callers_of("make_placeholders")} == {"memmode_core/loading/components.py"}


if __name__ == "__main__":
    lines = [str(v) for v in violations()]
    text = "\n".join(lines) + ("\n" if lines else "")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text)
    print(text, end="")
    print(f"{len(lines)} violations", file=sys.stderr)
