"""Plugin discovery: built-ins, entry points, isolation of broken plugins, duplicates, env vars."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
import types

import pytest
import torch

import memmode_core as memmode
from fake_plugins import PoisonPlugin
from helpers import assert_same_tensors, state_of
from memmode_core import hookimpl
from memmode_core.contracts.errors import (
    DuplicatePluginError,
    InvalidOptionError,
    PluginKitError,
    PluginLoadError,
    UnknownModeError,
)
from memmode_core.contracts.storage import Storage
from memmode_core.contracts.versions import kit_provides, parse_kit
from memmode_core.discovery import plugins
from memmode_core.discovery.compatibility import requirement_refusal
from memmode_core.discovery.disabling import AUTOLOAD_ENV, DISABLE_ENV
from memmode_core.plugin import KIT_VERSION

# -- fake distributions, as pytest's own tests fake them ------------------------------------------


class FakeEntryPoint:
    def __init__(self, name: str, obj=None, *, error: BaseException | None = None, group: str = "memmode"):
        self.name, self.group, self._obj, self._error = name, group, obj, error
        self.loaded = 0

    def load(self):
        self.loaded += 1
        if self._error is not None:
            raise self._error
        return self._obj


class FakeDistribution:
    def __init__(self, name: str, version: str, entry_points, requires: list[str] | None = None):
        self.metadata = {"Name": name}
        self.version = version
        self.entry_points = list(entry_points)
        self.requires = requires


def storage_plugin(*names: str, description: str = "fake"):
    """A plugin module registering one fake storage per name."""
    module = types.ModuleType(f"fake_plugin_{'_'.join(names)}")

    class FakeStorage(Storage):
        def open(self, *, device, offload_dir, options):
            return memmode_core_ram_session()

    def make(name):
        storage = FakeStorage()
        storage.name, storage.description = name, description
        return storage

    @hookimpl
    def memmode_register_storages(register):
        for name in names:
            register(make(name))

    module.memmode_register_storages = memmode_register_storages
    return module


def memmode_core_ram_session():
    from memmode_core.builtin.ram import RamSession

    return RamSession()


@pytest.fixture
def installed(monkeypatch):
    """Replace the installed distributions by the given fakes."""

    def install(*distributions):
        monkeypatch.setattr(importlib.metadata, "distributions", lambda: list(distributions))
        plugins.reset()

    return install


def rows(kind=None):
    return [r for r in memmode.list_plugins() if kind is None or r.kind == kind]


def row(name):
    (found,) = [r for r in memmode.list_plugins() if r.name == name]
    return found


# -- built-ins --------------------------------------------------------------------------------------


def test_builtins_register_through_the_hooks_with_the_core_distribution(installed):
    installed()
    names = {(r.kind, r.name) for r in rows()}
    assert {
        ("placement", n)
        for n in (
            "model_full_load",
            "model_cpu_offload",
            "model_group_offload",
            "sequential_cpu_offload",
            "text_encoder_offload",
        )
    } <= names
    assert ("storage", "ram") in names
    for r in rows():
        assert r.distribution == "memmode-core"
        assert r.version == importlib.metadata.version("memmode-core")
        assert r.available and r.reason is None and r.description


def test_discovery_is_lazy_and_imports_no_plugin_at_import_time():
    code = (
        "import sys, memmode_core\n"
        "from memmode_core.discovery import plugins\n"
        "assert plugins._cache is None, 'discovery ran at import'\n"
        "loaded = [m for m in sys.modules if m.startswith('memmode_') and m != 'memmode_core' "
        "and not m.startswith('memmode_core.')]\n"
        "assert not loaded, loaded\n"
        "assert 'diffusers' not in sys.modules and 'transformers' not in sys.modules\n"
        "memmode_core.list_plugins()\n"
        "assert plugins._cache is not None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_discovery_is_cached_until_its_inputs_change(installed, monkeypatch):
    installed()
    first = plugins.current()
    assert plugins.current() is first
    monkeypatch.setenv(DISABLE_ENV, "nothing-by-this-name")
    assert plugins.current() is not first


# -- entry points -------------------------------------------------------------------------------------


def test_entry_point_plugin_is_found_with_its_distribution_and_version(installed):
    ep = FakeEntryPoint("fakestore", storage_plugin("fakestore"))
    installed(FakeDistribution("memmode-fakestore", "1.2.3", [ep, FakeEntryPoint("other", None, group="other")]))
    r = row("fakestore")
    assert (r.kind, r.distribution, r.version, r.available) == ("storage", "memmode-fakestore", "1.2.3", True)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    handle = memmode.apply(net, "model_cpu_offload", device="cpu", storage="fakestore")
    assert handle.storage == "fakestore"
    handle.remove()


def test_a_distribution_found_twice_on_the_path_counts_once(installed):
    module = storage_plugin("fakestore")
    installed(
        FakeDistribution("memmode-fakestore", "1.0", [FakeEntryPoint("fakestore", module)]),
        FakeDistribution("memmode_FakeStore", "1.0", [FakeEntryPoint("fakestore", module)]),
    )
    assert len([r for r in rows() if r.name == "fakestore"]) == 1


def test_a_plugin_that_fails_to_import_is_isolated_and_named(installed):
    good = FakeEntryPoint("fakestore", storage_plugin("fakestore"))
    bad = FakeEntryPoint("broken", error=ModuleNotFoundError("No module named 'missing_dependency'"))
    installed(FakeDistribution("memmode-broken", "0.1", [bad]), FakeDistribution("memmode-fakestore", "1.0", [good]))
    assert row("fakestore").available
    broken = row("broken")
    assert (broken.kind, broken.distribution, broken.available) == ("plugin", "memmode-broken", False)
    assert "missing_dependency" in broken.reason
    with pytest.raises(PluginLoadError, match="memmode-broken") as raised:
        memmode.apply(torch.nn.Linear(2, 2), "model_cpu_offload", device="cpu", storage="whatever")
    assert "missing_dependency" in str(raised.value)


def test_a_broken_first_party_plugin_is_named_when_its_mode_is_used(installed):
    bad = FakeEntryPoint("qfloat8", error=ImportError("cannot import name 'float8_e4m3fn'"))
    installed(FakeDistribution("memmode-qfloat8", "0.1", [bad]))
    with pytest.raises(PluginLoadError, match="memmode-qfloat8.*failed to load"):
        memmode.apply(torch.nn.Linear(2, 2), "model_full_load_and_qfloat8", device="cpu")


def test_a_hook_that_raises_isolates_its_plugin_and_keeps_nothing_of_it(installed):
    module = types.ModuleType("half_broken")

    class Good(Storage):
        name, description = "halfgood", "registered before the failure"

    @hookimpl
    def memmode_register_storages(register):
        register(Good())
        raise RuntimeError("boom while registering")

    module.memmode_register_storages = memmode_register_storages
    installed(FakeDistribution("memmode-half", "2.0", [FakeEntryPoint("half", module)]))
    assert not [r for r in rows() if r.name == "halfgood"]
    failure = row("half")
    assert not failure.available and "boom while registering" in failure.reason
    assert row("ram").available


@pytest.mark.parametrize(
    "registered, message",
    [
        (object(), "takes a memmode_core.Storage"),
        ("bad name", "must be lowercase"),
    ],
)
def test_invalid_registrations_are_plugin_failures(installed, registered, message):
    module = types.ModuleType("invalid")

    class Named(Storage):
        name = "bad name"

    @hookimpl
    def memmode_register_storages(register):
        register(Named() if registered == "bad name" else registered)

    module.memmode_register_storages = memmode_register_storages
    installed(FakeDistribution("memmode-invalid", "1.0", [FakeEntryPoint("invalid", module)]))
    assert message in row("invalid").reason


def test_a_misspelt_hook_makes_the_plugin_invalid(installed):
    module = types.ModuleType("typo")

    @hookimpl
    def memmode_register_storage(register):  # missing the final s
        raise AssertionError("must not be called")

    module.memmode_register_storage = memmode_register_storage
    installed(FakeDistribution("memmode-typo", "1.0", [FakeEntryPoint("typo", module)]))
    assert "unknown hook 'memmode_register_storage'" in row("typo").reason


def test_a_clash_makes_only_that_name_an_error(installed):
    """Two packages registering one name: that name is an error naming both; every other mode, and the
    listing (both rows, the clash as the reason), keep working."""
    installed(
        FakeDistribution("memmode-first", "1.0", [FakeEntryPoint("first", storage_plugin("twin", "solo"))]),
        FakeDistribution("memmode-second", "2.0", [FakeEntryPoint("second", storage_plugin("twin"))]),
    )
    twins = [r for r in memmode.list_plugins() if r.name == "twin"]
    assert {r.distribution for r in twins} == {"memmode-first", "memmode-second"}
    assert all(not r.available and "clash" in r.reason for r in twins)
    assert row("solo").available and row("ram").available
    handle = memmode.apply(torch.nn.Linear(2, 2), "model_group_offload", device="cpu", storage="solo")
    handle.remove()
    with pytest.raises(DuplicatePluginError) as raised:
        memmode.apply(torch.nn.Linear(2, 2), "model_group_offload", device="cpu", storage="twin")
    message = str(raised.value)
    assert "memmode-first" in message and "memmode-second" in message and isinstance(raised.value, ValueError)
    assert "MEMMODE_DISABLE_PLUGINS=memmode-second:twin" in message


def test_the_suggested_fix_for_a_clash_picks_one_provider(installed, monkeypatch):
    first, second = storage_plugin("twin", "solo"), storage_plugin("twin")
    installed(
        FakeDistribution("memmode-first", "1.0", [FakeEntryPoint("twin", first)]),
        FakeDistribution("memmode-second", "2.0", [FakeEntryPoint("second", second)]),
    )
    with pytest.raises(DuplicatePluginError) as raised:
        memmode.apply(torch.nn.Linear(2, 2), "model_group_offload", device="cpu", storage="twin")
    suggestion = re.search(r"MEMMODE_DISABLE_PLUGINS=(\S+)", str(raised.value)).group(1)
    monkeypatch.setenv(DISABLE_ENV, suggestion)
    available = [r for r in memmode.list_plugins() if r.name == "twin" and r.available]
    assert [r.distribution for r in available] == ["memmode-first"]
    (off,) = [r for r in memmode.list_plugins() if r.name == "twin" and not r.available]
    assert off.distribution == "memmode-second" and "disabled" in off.reason  # still listed, with why
    assert row("solo").available
    memmode.apply(torch.nn.Linear(2, 2), "model_group_offload", device="cpu", storage="twin").remove()


def test_a_plugin_clashing_with_a_builtin_is_a_duplicate(installed):
    installed(FakeDistribution("memmode-myram", "1.0", [FakeEntryPoint("myram", storage_plugin("ram"))]))
    with pytest.raises(DuplicatePluginError, match="memmode-core.*memmode-myram"):
        memmode.apply(torch.nn.Linear(2, 2), "model_group_offload", device="cpu", storage="ram")
    memmode.apply(torch.nn.Linear(2, 2), "model_full_load", device="cpu").remove()  # needs no storage: works


def test_an_unknown_name_from_a_disabled_plugin_says_it_is_disabled(installed, monkeypatch):
    installed(FakeDistribution("memmode-extra", "1.0", [FakeEntryPoint("extra", storage_plugin("zstore"))]))
    monkeypatch.setenv(DISABLE_ENV, "memmode-extra")
    with pytest.raises(UnknownModeError, match="zstore.*memmode-extra.*disabled by MEMMODE_DISABLE_PLUGINS"):
        memmode.apply(torch.nn.Linear(2, 2), "model_group_offload", device="cpu", storage="zstore")


def test_a_broken_plugins_row_says_what_it_would_have_provided(installed):
    module = types.ModuleType("halfbroken")

    @hookimpl
    def memmode_register_quantizers(register):
        raise RuntimeError("no GPU kernels here")

    module.memmode_register_quantizers = memmode_register_quantizers
    installed(FakeDistribution("memmode-halfbroken", "1.0", [FakeEntryPoint("halfbroken", module)]))
    broken = row("halfbroken")
    assert not broken.available and "no GPU kernels" in broken.reason
    assert "would provide: quantizer" in broken.description


# -- the plugin kit a plugin was built for -------------------------------------------------------------


def kit_plugin(built_for, *names: str):
    """A plugin module registering fake storages, stating the kit it was built for (None: stating none)."""
    module = storage_plugin(*names)
    if built_for is not None:
        module.MEMMODE_KIT = built_for
    return module


@pytest.mark.parametrize(
    "distribution, package",
    [
        ("memmode-core", "memmode_core"),
        ("memmode-qfloat8", "memmode_qfloat8"),
        ("memmode-qfloat4", "memmode_qfloat4"),
        ("memmode-storage-pinned", "memmode_storage_pinned"),
        ("memmode-storage-disk", "memmode_storage_disk"),
        ("memmode-storage-mmap", "memmode_storage_mmap"),
        ("memmode-gguf", "memmode_gguf"),
    ],
)
def test_each_distribution_has_one_version_and_states_its_kit(distribution, package):
    """The version written once in the package is the one its installed metadata says (pyproject.toml reads it),
    and every first-party plugin states a kit this core provides (the one it was built for: kit 1.1 only added
    readers) and requires the cores that provide it."""
    module = importlib.import_module(package)
    assert module.__version__ == importlib.metadata.version(distribution)
    if distribution == "memmode-core":
        return
    assert kit_provides(importlib.import_module(f"{package}.plugin").MEMMODE_KIT, KIT_VERSION)
    (core,) = [r for r in importlib.metadata.requires(distribution) if r.startswith("memmode-core")]
    assert requirement_refusal([core], memmode.__version__) is None


def test_kit_versions_compare_by_major_and_minor():
    assert kit_provides("1.0", "1.0") and kit_provides("1.0", "1.3") and kit_provides("1.3", "1.3")
    assert not kit_provides("1.4", "1.3") and not kit_provides("2.0", "1.3") and not kit_provides("0.9", "1.0")
    for bad in ("1", "1.x", "v1.0", 1.0, None):
        with pytest.raises(ValueError, match="MAJOR.MINOR"):
            parse_kit(bad)


@pytest.mark.parametrize(
    "built_for, advice", [("2.0", "upgrade memmode-core"), ("0.9", f"built for kit {KIT_VERSION}")]
)
def test_a_plugin_built_for_a_kit_core_does_not_provide_is_refused_naming_both_versions(installed, built_for, advice):
    ep = FakeEntryPoint("otherkit", kit_plugin(built_for, "otherkitstore"))
    installed(
        FakeDistribution("memmode-otherkit", "3.1", [ep]),
        FakeDistribution(
            "memmode-kitok",
            "1.0",
            [
                FakeEntryPoint("kitok", kit_plugin(KIT_VERSION, "kitokstore")),
                FakeEntryPoint("unstated", kit_plugin(None, "unstatedstore")),
            ],
        ),
    )
    assert row("kitokstore").available and row("unstatedstore").available, "the same kit, or none stated (1.0)"
    refused = row("otherkit")
    assert (refused.kind, refused.distribution, refused.available) == ("plugin", "memmode-otherkit", False)
    assert not [r for r in rows() if r.name == "otherkitstore"], "none of its hooks ran"
    expected = [f"plugin kit {built_for}", f"memmode-core {memmode.__version__} (plugin kit {KIT_VERSION})", advice]
    assert all(part in refused.reason for part in expected), refused.reason
    with pytest.raises(PluginKitError, match="memmode-otherkit") as raised:
        memmode.apply(torch.nn.Linear(2, 2), "model_cpu_offload", device="cpu", storage="otherkitstore")
    assert isinstance(raised.value, PluginLoadError)
    assert all(part in str(raised.value) for part in expected), raised.value


def test_a_first_party_plugin_built_for_another_kit_is_named_when_its_mode_is_used(installed):
    module = types.ModuleType("memmode_qfloat8_next")
    module.MEMMODE_KIT = "2.0"
    installed(FakeDistribution("memmode-qfloat8", "0.9", [FakeEntryPoint("memmode_qfloat8", module)]))
    with pytest.raises(PluginKitError, match=rf"memmode-qfloat8 0\.9.*plugin kit 2\.0.*plugin kit {KIT_VERSION}"):
        memmode.apply(torch.nn.Linear(2, 2), "model_full_load_and_qfloat8", device="cpu")


def test_an_in_process_plugin_is_checked_too():
    with memmode.temporary_plugin(kit_plugin("1.99", "newerstore"), name="newer", distribution="memmode-newer"):
        refused = row("newer")
        assert not refused.available and "plugin kit 1.99" in refused.reason
        with memmode.temporary_plugin(kit_plugin("one", "oddstore"), name="odd"):
            assert "'one' is not a kit version" in row("odd").reason


def test_a_distribution_requiring_another_core_is_refused_before_it_is_imported(installed):
    ep = FakeEntryPoint("later", kit_plugin("1.0", "laterstore"))
    extra = FakeEntryPoint("extras", kit_plugin("1.0", "extrasstore"))
    installed(
        FakeDistribution("memmode-later", "5.0", [ep], requires=["torch>=2.4", "memmode-core<0.9,>=0.5"]),
        FakeDistribution("memmode-extras", "1.0", [extra], requires=['memmode-core>=9; extra == "dev"']),
    )
    assert row("extrasstore").available, "a requirement under an extra is the user's choice"
    refused = row("later")
    assert ep.loaded == 0, "not imported"
    assert "memmode-core<0.9,>=0.5" in refused.reason and f"memmode-core {memmode.__version__}" in refused.reason
    with pytest.raises(PluginKitError, match=r"memmode-later 5\.0.*requires memmode-core<0\.9,>=0\.5"):
        memmode.apply(torch.nn.Linear(2, 2), "model_cpu_offload", device="cpu", storage="laterstore")


def test_a_plugin_importing_what_the_kit_does_not_have_is_a_kit_error(installed):
    """The ImportError a plugin built for a later kit raises deep inside its import becomes a kit refusal; an
    import of something else that is missing stays the plugin's own failure."""
    later = FakeEntryPoint(
        "later",
        error=ImportError("cannot import name 'NewThing' from 'memmode_core.plugin'", name="memmode_core.plugin"),
    )
    other = FakeEntryPoint("other", error=ModuleNotFoundError("No module named 'zstd'", name="zstd"))
    installed(FakeDistribution("memmode-later", "2.0", [later]), FakeDistribution("memmode-other", "1.0", [other]))
    assert "built for another plugin kit" in row("later").reason and "NewThing" in row("later").reason
    assert "built for another plugin kit" not in row("other").reason
    with pytest.raises(PluginKitError, match="NewThing"):
        memmode.apply(torch.nn.Linear(2, 2), "model_cpu_offload", device="cpu", storage="whatever")


# -- environment variables -----------------------------------------------------------------------------


def test_autoload_can_be_disabled(installed, monkeypatch):
    ep = FakeEntryPoint("fakestore", storage_plugin("fakestore"))
    installed(FakeDistribution("memmode-fakestore", "1.0", [ep]))
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    assert not [r for r in rows() if r.name == "fakestore"]
    assert ep.loaded == 0
    assert row("ram").available  # built-ins still register


@pytest.mark.parametrize("blocked", ["fakestore", "memmode-fakestore", "memmode_FakeStore", "extra"])
def test_plugins_can_be_disabled_by_plugin_distribution_or_registration_name(installed, monkeypatch, blocked):
    ep = FakeEntryPoint("fakestore", storage_plugin("extra", "second"))
    installed(FakeDistribution("memmode-fakestore", "1.0", [ep]))
    monkeypatch.setenv(DISABLE_ENV, f"unrelated, {blocked}")
    names = {r.name for r in rows("storage") if r.available}
    assert "extra" not in names
    if blocked == "extra":  # only that registration goes
        assert "second" in names
    else:
        assert "second" not in names and ep.loaded == 0
        assert "disabled" in row("fakestore").reason
    with pytest.raises(UnknownModeError):
        memmode.apply(torch.nn.Linear(2, 2), "model_cpu_offload", device="cpu", storage="extra")


def test_builtins_can_be_disabled_too(installed, monkeypatch):
    installed()
    monkeypatch.setenv(DISABLE_ENV, "memmode-core.ram")
    assert "ram" not in {r.name for r in rows("storage")}


# -- in-process registration ------------------------------------------------------------------------------


def test_temporary_plugins_do_not_leak(installed):
    installed()
    with memmode.temporary_plugin(PoisonPlugin(), name="poison", distribution="tests", version="0"):
        assert row("poison").distribution == "tests"
    assert not [r for r in rows() if r.name == "poison"]


def test_two_plugins_of_one_mode_declaring_one_option_is_an_error_naming_both(installed):
    """Options are one flat namespace per mode: a storage declaring the placement's option name would
    silently receive the placement's value, so it is refused at apply, naming both."""
    from memmode_core import Option

    class Greedy(Storage):
        name = "greedy"
        description = "declares a placement's option"
        options = (Option("offload_type", "x", "clashes with model_group_offload"),)

        def open(self, *, device, offload_dir, options):
            raise AssertionError("must be refused before opening")

    class GreedyPlugin:
        @hookimpl
        def memmode_register_storages(self, register):
            register(Greedy())

    installed()
    target = torch.nn.Linear(2, 2)
    before = target.weight.detach().clone()
    with memmode.temporary_plugin(GreedyPlugin(), name="greedy", distribution="memmode-greedy"):
        with pytest.raises(InvalidOptionError, match="'offload_type'.*placement model_group_offload.*storage greedy"):
            memmode.apply(target, "model_group_offload", device="cpu", storage="greedy", offload_type="leaf_level")
        memmode.apply(target, "model_cpu_offload", device="cpu", storage="ram").remove()  # other modes still work
    assert torch.equal(target.weight, before) and not hasattr(target, "_memmode_handle")


class _Layout(memmode.Placement):
    """A third-party placement whose layout is given by the test."""

    name = "given_layout"
    description = "test placement"

    def __init__(self, make):
        self.make = make

    def layout(self, target, options):
        return self.make(target.components["module"])


@pytest.mark.parametrize(
    "bug, match",
    [
        ("same key", "several groups under the key 'module/x'"),
        ("module left out", r"left module\.1 \(Linear\).*out of every group"),
    ],
)
def test_a_malformed_layout_is_refused_before_anything_changes(installed, bug, match):
    from memmode_core import GroupSpec

    target = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    before = state_of(target)
    if bug == "same key":

        def make(m):
            return [
                GroupSpec("module/x", "module", [m[0]], [m[0]], [m[0]]),
                GroupSpec("module/x", "module", [m[1]], [m[1]], [m[1]]),
            ]
    else:

        def make(m):
            return [GroupSpec("module/0", "module", [m[0]], [m[0]], [m[0]])]

    class Plugin:
        @hookimpl
        def memmode_register_placements(self, register):
            register(_Layout(make))

    installed()
    with (
        memmode.temporary_plugin(Plugin(), name="given", distribution="memmode-given"),
        memmode.temporary_plugin(PoisonPlugin(), name="poison", distribution="tests"),
    ):
        for storage in ("ram", "poison"):
            with pytest.raises(memmode.IncompatibleModeError, match=match):
                memmode.apply(target, "given_layout", device="cpu", storage=storage)
    assert_same_tensors(state_of(target), before)
    assert not hasattr(target, "_memmode_handle")
