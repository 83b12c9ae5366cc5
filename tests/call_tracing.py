"""Where ``apply``'s mode goes: the modules the request passes through, and every call up a layer.

``trace_apply(pipe, mode)`` runs ``apply`` (``trace_load(folder, mode)``: ``load``) under ``sys.setprofile``;
``tests/test_call_path.py`` checks what it finds and ``benchmarks/call_path.py`` prints it. Two things are
counted (and :func:`follow_arguments` follows each argument of the request by name):

- **stops**: the *request's path* is every call that receives the request as it travels: the mode string, the
  parsed ``Mode``, the ``Request`` or the ``Prepared``. A stop is such a call made from another module than its
  nearest caller on the path (a module entered); a module entered more than once is a *re-entry* (the request
  went there, left, and came back);
- **calls up**: any call, on the path or not, from a module of one layer into a function defined in a module of
  a higher layer (the layers of ``tests/layers.py``, those ``tests/test_import_layers.py`` enforces for
  imports): a callback handed down, or a method of an object made above. A call into a registered plugin's
  contract method (``Placement.layout``, ``StorageSession.fetch``...) is a call through the plugin boundary
  and is listed apart: a third-party plugin is in no layer, and the built-in ones are loaded like them.
"""

from __future__ import annotations

import collections
import importlib
import sys
from dataclasses import dataclass, field

from layers import layer_of_module

#: the modes traced by default: a placement alone, with a quantizer, at leaf level, and a resolver
DEFAULT_MODES = ("model_group_offload", "model_group_offload_and_qfloat8", "sequential_cpu_offload", "auto")


def _contract_bases():
    import memmode_core as memmode

    return (
        memmode.Placement,
        memmode.Quantizer,
        memmode.Storage,
        memmode.StorageSession,
        memmode.Resolver,
        memmode.Options,
    )


def _is_plugin_module(name: str) -> bool:
    """The built-in plugins (loaded by name, like entry points) and plugin distributions."""
    return name.startswith("memmode_core.builtin") or not name.startswith("memmode_core")


def _carries_request(value, mode: str, kinds: tuple[type, ...]) -> bool:
    """The mode string itself (the very object the user passed: a plugin's name equal to it is not it), or an
    object made from it."""
    return value is mode or isinstance(value, kinds)


def _arguments(frame):
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    if code.co_flags & 0x04:  # *args
        names.append(code.co_varnames[count])
        count += 1
    if code.co_flags & 0x08:  # **kwargs
        names.append(code.co_varnames[count])
    values = []
    for name in names:
        value = frame.f_locals.get(name)
        if isinstance(value, tuple):
            values.extend(value)
        elif isinstance(value, dict) and name == names[-1] and code.co_flags & 0x08:
            values.extend(value.values())
        else:
            values.append(value)
    return values


@dataclass
class CallPath:
    """What one traced ``apply`` did: the stops of the request's path in order, ``(module, function)``; the calls
    up a layer and the calls into plugins made from a lower layer, ``(caller module, callee module, function)``
    -> count."""

    stops: list[tuple[str, str]] = field(default_factory=list)
    calls_up: collections.Counter = field(default_factory=collections.Counter)
    plugin_calls: collections.Counter = field(default_factory=collections.Counter)

    @property
    def entered_again(self) -> dict[str, int]:
        """Modules the request's path entered more than once, and how often."""
        entered = collections.Counter(module for module, _ in self.stops)
        return {module: count for module, count in entered.items() if count > 1}


def trace_apply(pipe, mode: str, **kwargs) -> CallPath:
    """``memmode.apply(pipe, mode, **kwargs)`` traced (then removed)."""
    import memmode_core as memmode

    mode = "".join(mode)  # a string object of the caller's own, as a user's is (a literal may be interned)
    path, handle = trace(memmode.apply, pipe, mode, mode=mode, **kwargs)
    handle.remove()
    return path


def trace_load(folder, mode: str, **kwargs) -> CallPath:
    """``memmode.load(folder, mode, **kwargs)`` traced (then removed): the path of a request made before the
    model exists."""
    import memmode_core as memmode

    mode = "".join(mode)
    path, handle = trace(memmode.load, folder, mode, mode=mode, **kwargs)
    handle.remove()
    return path


def trace(function, *args, mode: str | None = None, **kwargs) -> tuple[CallPath, object]:
    """``function(*args, **kwargs)`` traced, and what it returned (or the path alone where it raised, as the
    exception's ``call_path``): ``mode`` is the mode string whose path is followed (none: calls up only)."""
    request_kinds = _request_kinds()
    bases = _contract_bases()
    path_stack: list[tuple[object, str]] = []  # (frame, module) of the path's calls now running
    entered: set[tuple[int, str]] = set()  # (id of the calling frame on the path, module entered)
    stops: list[tuple[str, str]] = []  # (module, function)
    ups: collections.Counter = collections.Counter()
    through_plugins: collections.Counter = collections.Counter()

    def module_of(frame) -> str | None:
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith(("memmode_core", "memmode_")) else None

    def profile(frame, event, arg):
        if event == "return":
            if path_stack and path_stack[-1][0] is frame:
                path_stack.pop()
            return
        if event != "call":
            return
        callee = module_of(frame)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and module_of(caller_frame) is None:
            caller_frame = caller_frame.f_back
        caller = module_of(caller_frame) if caller_frame is not None else None
        function = frame.f_code.co_qualname
        if caller is not None and caller != callee and layer_of_module(callee) > layer_of_module(caller):
            owner = frame.f_locals.get("self")
            into_plugin = _is_plugin_module(callee) or (owner is not None and isinstance(owner, bases))
            (through_plugins if into_plugin else ups)[(caller, callee, function)] += 1
        arguments = _arguments(frame)
        if frame.f_code.co_argcount and frame.f_code.co_varnames[0] == "self":
            arguments = arguments[1:]  # a method of the request itself is not a stop: it is where the request is
        if "__create_fn__" in function:  # a dataclass's generated __init__: the request being made, not a stop
            return
        if mode is not None and any(_carries_request(v, mode, request_kinds) for v in arguments):
            parent = path_stack[-1] if path_stack else (None, None)
            # a loop in one frame calling into one module again (a resolver's candidates) enters it once
            if parent[1] != callee and (id(parent[0]), callee) not in entered:
                entered.add((id(parent[0]), callee))
                stops.append((callee, function))
            path_stack.append((frame, callee))

    previous = sys.getprofile()
    path = CallPath(stops, ups, through_plugins)
    sys.setprofile(profile)
    try:
        result = function(*args, **kwargs)
    except Exception as exc:
        exc.call_path = path
        raise
    finally:
        sys.setprofile(previous)
    return path, result


def follow_arguments(function, *args, followed: dict[str, object], **kwargs) -> tuple[dict[str, list[str]], object]:
    """``function(*args, **followed, **kwargs)`` traced for where each argument of ``followed`` goes by name: for
    each, the functions of memmode that received that very object (or, for a singleton such as ``False`` or a
    dtype, an equal one) as a parameter of the same name, in call order (``"memmode_core.applying.prepare"``).

    A function that receives a field inside a bag (``locals()``, ``**kwargs`` handed on whole) is not on its trail:
    the trail stops where a reader following the name would lose it."""
    trails: dict[str, list[str]] = {name: [] for name in followed}

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("memmode_core"):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        for name in names:
            if name not in followed:
                continue
            value, wanted = frame.f_locals.get(name), followed[name]
            singleton = isinstance(wanted, (bool, type(None))) or type(wanted).__name__ == "dtype"
            if value is wanted or (singleton and value == wanted):
                trails[name].append(f"{module}.{code.co_qualname}")

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = function(*args, **followed, **kwargs)
    finally:
        sys.setprofile(previous)
    return trails, result


def _request_kinds() -> tuple[type, ...]:
    import memmode_core as memmode

    kinds = [memmode.Mode, memmode.Prepared]
    for where in ("memmode_core.planning.request", "memmode_core.planning.prepared"):  # today's home, then the old
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        if hasattr(module, "Request"):
            kinds.append(module.Request)
            break
    return tuple(kinds)
