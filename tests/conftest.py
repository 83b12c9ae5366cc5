"""The suite's fixtures and pytest hooks (what tests share besides fixtures is in ``helpers.py``)."""

from __future__ import annotations

import gc
import importlib.metadata
import os
import re
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

import memmode_core as memmode
from fake_plugins import Int8Plugin, PoisonPlugin
from helpers import HAS_CUDA
from memmode_core.discovery import plugins, sources
from memmode_core.discovery.disabling import AUTOLOAD_ENV, DISABLE_ENV
from memmode_core.engine.streams import installed
from memmode_core.testing import StrictStreams
from tiny_pipelines import FAMILIES


def pytest_configure(config):
    """The newest- and lowest-versions lanes (``.ci/distributions.py newest``, ``lowest``) run the suite against the
    installed wheels: there, memmode and its plugins must come from the virtual environment, never from this
    checkout."""
    if os.environ.get("MEMMODE_TEST_FROM_WHEELS") != "1":
        return
    import memmode_gguf
    import memmode_qfloat4
    import memmode_qfloat8
    import memmode_storage_disk
    import memmode_storage_mmap
    import memmode_storage_pinned

    checkout = Path(__file__).resolve().parent.parent
    for module in (
        memmode,
        memmode_qfloat8,
        memmode_qfloat4,
        memmode_storage_pinned,
        memmode_storage_disk,
        memmode_storage_mmap,
        memmode_gguf,
    ):
        where = Path(module.__file__).resolve()
        assert checkout not in where.parents, f"{module.__name__} comes from the checkout ({where}), not a wheel"


# The suite's pipelines are tiny: one thread runs them fastest, and two threads fighting over two
# busy cores make each call tens of times slower.
torch.set_num_threads(1)


# Discovery reads the metadata of every installed distribution (``importlib.metadata``: dozens of files
# parsed as e-mail headers, 35 ms on a quiet core, 0.1 s on a busy one), and every test starts a fresh
# discovery (``isolated_plugins``, and each ``temporary_plugin`` changes the cache key): over a thousand
# tests, that was between half a minute and a minute and a half of the suite on two cores. The installed
# distributions do not change during a session, so their entry points are read once per ``sys.path``; each
# discovery still loads every entry point and registers every plugin anew, and a test that fakes the
# installed distributions (``monkeypatch.setattr(importlib.metadata, "distributions", ...)``, as
# ``test_core_plugins`` does) gets the real, uncached scan of its fakes.
_REAL_DISTRIBUTIONS = importlib.metadata.distributions
_real_entry_points = sources._entry_points  # an AttributeError here, not a silently slower suite, if it moves
_ENTRY_POINTS: dict[tuple[str, ...], list] = {}


def _entry_points_read_once() -> list:
    if importlib.metadata.distributions is not _REAL_DISTRIBUTIONS:
        return _real_entry_points()
    key = tuple(sys.path)
    if key not in _ENTRY_POINTS:
        _ENTRY_POINTS[key] = _real_entry_points()
    return list(_ENTRY_POINTS[key])


sources._entry_points = _entry_points_read_once


#: what a test that compares computed numbers calls (``helpers``' comparisons, torch's own): a module that names one
#: is a module of such tests
_COMPARES_NUMBERS = re.compile(
    r"\b(assert_bit_equal|assert_same_outputs|assert_reassociated|assert_close|allclose|torch\.equal|sqnr_db)\b"
)


def pytest_collection_modifyitems(config, items):
    """Every test of a module that compares computed numbers is marked ``numerics``: CI runs those again under the
    kernel paths other CPUs take (``ATEN_CPU_CAPABILITY=default`` and ``avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: see
    ``.ci/run``), found from the source, so that a new such module joins those runs without anyone marking it."""
    compares: dict[Path, bool] = {}
    for item in items:
        path = Path(item.fspath)
        if path not in compares:
            compares[path] = bool(_COMPARES_NUMBERS.search(path.read_text()))
        if compares[path]:
            item.add_marker(pytest.mark.numerics)


def pytest_collection_finish(session):
    """Less garbage collection: with the default thresholds, Python's full collections walked every object
    of torch, diffusers and transformers (hundreds of thousands) a few dozen times per file, about a tenth
    of the suite's time.  What exists once the tests are collected lives until the end: it is frozen out
    of the collector's walks, and the young generations are collected less often (the tiny pipelines make
    many short-lived objects).  Nothing in the suite depends on when a cycle is collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


@pytest.fixture(autouse=True)
def isolated_plugins(monkeypatch):
    """Every test starts from a fresh discovery with the environment variables unset."""
    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture(autouse=True)
def strict_streams(request):
    """For tests marked ``accelerator`` (``helpers.on_accelerator``) without CUDA: the strict model of
    asynchronous copies, installed for the test (seeded by its name, so a failure repeats) and checked
    after it — every copy landed and finished, no buffer released or overwritten too early. The model
    (its ``counts`` say what ran), or None where the test runs on real CUDA or not on an accelerator."""
    if HAS_CUDA or request.node.get_closest_marker("accelerator") is None:
        yield None
        return
    model = StrictStreams(seed=zlib.crc32(request.node.nodeid.encode()))
    with installed(model):
        yield model
        model.check()
    assert not model.errors, f"errors the test swallowed: {model.errors}"


@pytest.fixture(autouse=True)
def no_stand_in_escapes(monkeypatch):
    """Suite-wide: no placed or quantized model ever gives a non-finite value to a read outside its forward.

    Whenever a test removes a placement, and for every placement still live when a test ends, every tensor of
    every placed component is read as a script would (``state_dict()``, then a computation with each value):
    each read gets a finite value, or a typed memmode error (a weight whose stored copy a test destroyed,
    ``strict=True``). A NaN or an infinity fails the test that left it, naming the tensor."""
    from memmode_core.engine import watch
    from memmode_core.engine.runtime import Runtime

    def check(runtime) -> None:
        if runtime.removed:
            return
        for component, module in runtime.components.items():
            try:
                state = module.state_dict()
            except memmode.MemmodeError:
                continue
            for name, tensor in state.items():
                if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_meta:
                    continue
                try:
                    with torch.no_grad():
                        finite = bool(torch.isfinite(tensor.to(torch.float32)).all())
                except memmode.MemmodeError:
                    continue
                assert finite, f"{component}.{name} read as a non-finite value outside its forward"

    original = Runtime.remove

    def remove(self) -> None:
        check(self)
        original(self)

    monkeypatch.setattr(Runtime, "remove", remove)
    before = {id(runtime) for runtime in watch.live_runtimes()}
    yield
    for runtime in watch.live_runtimes():
        if id(runtime) not in before:
            check(runtime)


@pytest.fixture
def poison_storage():
    """The test storage ``poison`` (NaN placeholders at rest; ``fake_plugins.PoisonStorage``), registered for one
    test."""
    with memmode.temporary_plugin(PoisonPlugin(), name="poison", distribution="tests"):
        yield


@pytest.fixture
def qint8():
    """The test quantizer ``qint8`` (``fake_plugins.Int8Rows``), registered for one test."""
    with memmode.temporary_plugin(Int8Plugin(), name="qint8", distribution="tests"):
        yield


@pytest.fixture
def private_tmp(monkeypatch, tmp_path):
    """The file storages' private default folders go here, to see them come and go."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    """Each of the five families memmode was written for (``tiny_pipelines.FAMILIES``)."""
    return request.param
