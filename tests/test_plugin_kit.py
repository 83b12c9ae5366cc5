"""The plugin kit (``memmode_core.plugin``) is the one door plugins use, memmode's own included.

Every file of the first-party plugin distributions under ``plugins/``, and every file of the four complete
packages of docs/writing-a-plugin.md, imports from memmode only the kit: a third-party plugin built from the
guide has every part the first-party ones use, and a refactor of memmode's internals breaks no plugin. The
check reads the source (``ast``), as ``test_import_layers`` does for memmode_core's own layers, and sees
imports inside functions and attribute access through ``import memmode_core``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import memmode_core
import memmode_core.plugin as kit
from helpers import assert_bit_equal
from plugin_guide import GUIDE, files_from_the_guide
from tiny_pipelines import full_load_outputs, make_pipeline, two_calls

ROOT = Path(__file__).resolve().parent.parent
KIT = "memmode_core.plugin"
PLUGIN_FILES = sorted((ROOT / "plugins").glob("*/*/*.py"))


def outside_the_kit(source: str) -> list[str]:
    """Each use of memmode in ``source`` that does not go through the kit, as ``line: what``."""
    tree = ast.parse(source)
    found = []
    package_names = set()  # names bound to memmode_core itself (``import memmode_core``)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "memmode_core":
                    package_names.add(alias.asname or alias.name)
                elif alias.name.startswith("memmode_core.") and alias.name != KIT:
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("memmode_core"):
            for alias in node.names:
                if node.module == KIT and alias.name in kit.__all__:
                    continue
                if node.module == "memmode_core" and alias.name == "plugin":
                    continue
                found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in package_names:
            if node.attr != "plugin":
                found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=lambda p: p.relative_to(ROOT / "plugins").as_posix())
def test_first_party_plugins_import_only_the_kit(path):
    assert outside_the_kit(path.read_text()) == []


def test_every_plugin_file_is_checked():
    packages = {path.parent.name for path in PLUGIN_FILES}
    assert packages == {
        "memmode_qfloat8",
        "memmode_qfloat4",
        "memmode_storage_pinned",
        "memmode_storage_disk",
        "memmode_storage_mmap",
        "memmode_gguf",
    }


@pytest.mark.parametrize("relative", sorted(p for p in files_from_the_guide() if p.endswith(".py")))
def test_the_guides_packages_import_only_the_kit(relative):
    assert outside_the_kit(files_from_the_guide()[relative]) == []


def test_the_check_sees_every_road_around_the_kit():
    source = (
        "import memmode_core\n"
        "import memmode_core.plugin as kit\n"
        "from memmode_core import plugin\n"
        "from memmode_core.plugin import Quantizer, hookimpl\n"
        "from memmode_core.engine.streams import active\n"
        "from memmode_core import Quantizer as Q\n"
        "from memmode_core.plugin import Runtime\n"
        "x = memmode_core.Quantizer\n"
        "y = memmode_core.plugin.Quantizer\n"
        "def f():\n"
        "    import memmode_core.files.store\n"
    )
    assert outside_the_kit(source) == [
        "5: from memmode_core.engine.streams import active",
        "6: from memmode_core import Quantizer",
        "7: from memmode_core.plugin import Runtime",
        "11: import memmode_core.files.store",
        "8: memmode_core.Quantizer",
    ]


def test_the_kit_exports_what_it_lists_and_what_the_package_root_shares_is_the_same_object():
    for name in kit.__all__:
        assert hasattr(kit, name), name
        if hasattr(memmode_core, name):  # re-exported at the root for users: one object, not a copy
            assert getattr(memmode_core, name) is getattr(kit, name), name


def _guide_block_after(sentence: str) -> str:
    text = GUIDE.read_text()
    start = text.index("```python\n", text.index(sentence)) + len("```python\n")
    return text[start : text.index("```", start)]


@pytest.mark.usefixtures("private_tmp")
def test_a_third_party_file_storage_built_from_the_kit_alone_is_exact():
    """The guide's ``readback`` storage (group files of its own, read back into fresh memory at every onload) is
    written with the kit only; registered, it runs group offload bit-exact, writes one file per group and
    leaves nothing behind."""
    namespace: dict = {}
    exec(compile(_guide_block_after("A storage that reads each group back"), "readback", "exec"), namespace)
    assert outside_the_kit(_guide_block_after("A storage that reads each group back")) == []

    class Plugin:
        @kit.hookimpl
        def memmode_register_storages(self, register):
            register(namespace["ReadBackStorage"]())

    expected = full_load_outputs("flux")
    pipe = make_pipeline("flux")
    with memmode_core.temporary_plugin(Plugin(), name="readback", distribution="memmode-readback"):
        handle = memmode_core.apply(pipe, "model_group_offload", device="cpu", storage="readback")
        stats = handle.report().storage_bytes
        assert stats["disk_bytes"] > 0 and stats["written_groups"] == len(handle.prepared.stored_sizes)
        folder = handle.runtime.session.store.folder
        got = two_calls(pipe, "flux")
        handle.remove()
    for a, b in zip(got, expected):
        assert_bit_equal(a, b)
    assert not folder.exists() or not any(folder.iterdir())


def _registered(obj, kind: str):
    class Plugin:
        @kit.hookimpl
        def memmode_register_placements(self, register):
            register(obj)

    return memmode_core.temporary_plugin(Plugin(), name=f"test-{obj.name}", distribution=f"memmode-{obj.name}")


def test_a_resolver_from_the_guide_chooses_among_the_priced_candidates():
    """The guide's ``smallest`` resolver subclasses ``PricingResolver`` and writes ``budgets`` and ``choose``: the
    plan it returns is the candidate with the least on the device, as ``plan`` prices it."""
    namespace: dict = {}
    block = _guide_block_after("subclasses `PricingResolver` and writes `budgets` and `choose`")
    assert outside_the_kit(block) == []
    exec(compile(block, "smallest", "exec"), namespace)
    pipe = make_pipeline("flux")
    with _registered(namespace["Smallest"](), "placement"):
        prepared = memmode_core.prepare(pipe, "smallest", device="cpu")
        entries = [e for e in memmode_core.plan(pipe, device="cpu") if e.fits]
    least = min(e.peak_device_bytes for e in entries)
    assert prepared.requested_mode == "smallest" and prepared.choice.peak_device_bytes == least
    assert prepared.choice.prepared.internal is prepared.internal  # the candidate as prepared, not again


def test_a_resolver_without_resolve_is_refused_naming_what_to_subclass():
    """A resolver written for the contract before ``resolve`` existed (only ``budgets`` and ``choose`` on
    ``Resolver``) is refused, typed, before anything is touched, saying to subclass ``PricingResolver``."""

    class OldStyle(kit.Resolver):
        name = "old_style"

        def budgets(self, options, device):
            return kit.Budgets(None, None, 20)

        def choose(self, entries, budgets):
            return entries[0]

    pipe = make_pipeline("flux")
    with _registered(OldStyle(), "placement"):
        with pytest.raises(memmode_core.IncompatibleModeError, match="PricingResolver"):
            memmode_core.apply(pipe, "old_style", device="cpu")
    assert not hasattr(pipe, "_memmode_handle")
