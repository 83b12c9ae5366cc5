"""``--option NAME=VALUE``: plugin options on the command line, read and checked before any work starts.

A VALUE is read as a Python literal when it is one, so that ``--option num_blocks_per_group=2`` passes the
number a plugin declares, not a string. An option that is an argument of ``apply`` or ``plan`` itself is a
usage error pointing at its flag, and one that no installed plugin declares is refused before minutes of
loading. Reading which options the plugins declare (:func:`_declared_option_names`) is the CLI's one use of
memmode_core beyond its public API: it has no public form yet.
"""

from __future__ import annotations

import argparse
import ast
import inspect

import memmode_core as memmode


def literal_value(text: str) -> object:
    """``'2'`` -> 2, ``'True'`` -> True, ``'[1, 2]'`` -> [1, 2]; what is not a Python literal stays a string
    (``'leaf_level'``, ``'8GiB'``, ``'/tmp/x'``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def parse_option(text: str) -> tuple[str, object]:
    """``--option NAME=VALUE`` -> ``(NAME, literal_value(VALUE))``."""
    name, equals, value = text.partition("=")
    name = name.strip()
    if not equals or not name or any(c.isspace() for c in name):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. offload_type=leaf_level), got {text!r}")
    return name, literal_value(value)


#: flags that set what an option of the same name would (``--option device=cuda`` means ``--device cuda``)
_FLAG_FOR = {
    "device": "--device",
    "storage": "--storage",
    "vram_budget": "--vram",
    "ram_budget": "--ram",
    "quantizer": "--quantizer",
    "steps": "--steps",
}


def given_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """``args.option`` as the keywords for ``apply`` (run) or ``plan``; usage errors through ``parser``."""
    parser = getattr(args, "subparser", parser)  # its usage line, not the top-level one
    pairs = getattr(args, "option", None) or []
    options: dict = {}
    for name, value in pairs:
        if name in options:
            parser.error(f"--option {name} given twice")
        options[name] = value
    if not options:
        return options
    function = memmode.plan if args.command == "plan" else memmode.apply
    own = [p.name for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    for name in options:
        if name in own:
            hint = f"; use {_FLAG_FOR[name]}" if name in _FLAG_FOR else ""
            parser.error(
                f"--option {name}: {name} is an argument of memmode_core.{function.__name__}, not a plugin option{hint}"
            )
    return options


def refuse_undeclared(options: dict) -> None:
    """An option no installed plugin declares is an ``InvalidOptionError``, before any pipeline is loaded
    (``plan`` itself ignores an option no candidate declares)."""
    if not options:
        return
    declared = _declared_option_names()
    unknown = sorted(set(options) - declared)
    if unknown:
        raise memmode.InvalidOptionError(
            f"unexpected option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: no installed placement, "
            f"storage or quantizer declares {'them' if len(unknown) > 1 else 'it'}; declared options: "
            f"{', '.join(sorted(declared)) or 'none'}"
        )


def _declared_option_names() -> set[str]:
    """The option names of every loaded plugin."""
    from memmode_core.contracts.options import declared_options
    from memmode_core.discovery import plugins

    registrations = plugins.current().registrations
    return {
        option.name
        for by_name in registrations.values()
        for registration in by_name.values()
        for option in declared_options(getattr(registration.obj, "options", ()))
    }


def describe_options(options: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options.items())
