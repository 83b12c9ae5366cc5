"""The mode grammar and the errors of name resolution."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import memmode_core as memmode
from memmode_core.contracts.errors import (
    DuplicatePluginError,
    IncompatibleModeError,
    InvalidOptionError,
    MemmodeError,
    PluginLoadError,
    PluginNotInstalledError,
    StorageUnavailableError,
    UnknownModeError,
)
from memmode_core.discovery import plugins
from memmode_core.discovery.disabling import AUTOLOAD_ENV


def refused(mode, error: type, match: str | None = None, **options) -> pytest.ExceptionInfo:
    """``apply`` of ``mode`` to a small module raises ``error`` (its message matching ``match``)."""
    with pytest.raises(error, match=match) as raised:
        memmode.apply(torch.nn.Linear(2, 2), mode, device="cpu", **options)
    return raised


@pytest.fixture
def nothing_installed(monkeypatch):
    """Only memmode-core's built-ins: no distribution provides an entry point."""
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [])
    plugins.reset()


@pytest.mark.parametrize(
    "mode, placement, quantizer",
    [
        ("model_cpu_offload", "model_cpu_offload", None),
        ("model_cpu_offload_and_qfloat8", "model_cpu_offload", "qfloat8"),
        ("model_group_offload_and_qfloat8_preconverted", "model_group_offload", "qfloat8_preconverted"),
        ("a_and_b_and_c", "a_and_b", "c"),  # split on the last separator
    ],
)
def test_parse_mode_splits_on_the_last_separator(mode, placement, quantizer):
    parsed = memmode.parse_mode(mode)
    assert (parsed.placement, parsed.quantizer) == (placement, quantizer)
    assert str(parsed) == mode


@pytest.mark.parametrize("mode", [None, 8, b"model_full_load", ["model_full_load"]])
def test_a_non_string_mode_is_a_type_error(mode):
    with pytest.raises(TypeError):
        memmode.parse_mode(mode)
    refused(mode, TypeError)


@pytest.mark.parametrize("mode", ["", "_and_qfloat8", "model_full_load_and_", " model_full_load"])
def test_malformed_modes_are_unknown(mode):
    with pytest.raises(UnknownModeError):
        memmode.parse_mode(mode)


def test_every_error_is_a_memmode_value_error():
    for error in (
        UnknownModeError,
        PluginNotInstalledError,
        PluginLoadError,
        IncompatibleModeError,
        StorageUnavailableError,
        DuplicatePluginError,
        InvalidOptionError,
    ):
        assert issubclass(error, MemmodeError) and issubclass(error, ValueError)
    assert issubclass(InvalidOptionError, TypeError)


def test_unknown_placement_lists_what_is_installed_and_the_closest_spelling(nothing_installed):
    raised = refused("model_cpu_ofload", UnknownModeError)
    message = str(raised.value)
    assert "model_full_load" in message and "model_group_offload" in message
    assert "Did you mean 'model_cpu_offload'" in message


def test_closest_spelling_of_a_whole_mode(nothing_installed):
    refused("model_group_offload_qfloat8", UnknownModeError, "Did you mean 'model_group_offload_and_qfloat8'")


@pytest.mark.parametrize(
    "mode, suggestion",
    [
        ("model_grup_offload_and_mystery", "model_group_offload_and_mystery"),  # the quantizer half is kept as written
        ("model_cpu_offload_and_qflot8", "model_cpu_offload_and_qfloat8"),  # the placement half is kept
    ],
)
def test_did_you_mean_changes_only_the_half_that_is_wrong(nothing_installed, mode, suggestion):
    refused(mode, UnknownModeError, f"Did you mean '{suggestion}'")


#: Modes with a first-party quantizer, and first-party storages: the distribution whose ``pip install`` the error names.
QUANTIZER_DISTRIBUTIONS = {
    "model_cpu_offload_and_qfloat8": "memmode-qfloat8",
    "model_group_offload_and_qfloat8_preconverted": "memmode-qfloat8",
    "sequential_cpu_offload_and_qfloat4": "memmode-qfloat4",
}
STORAGE_DISTRIBUTIONS = {
    "pinned": "memmode-storage-pinned",
    "disk": "memmode-storage-disk",
    "mmap": "memmode-storage-mmap",
}


@pytest.mark.parametrize("mode, package", list(QUANTIZER_DISTRIBUTIONS.items()))
def test_first_party_quantizer_not_installed(nothing_installed, mode, package):
    refused(mode, PluginNotInstalledError, f"pip install {package}")


@pytest.mark.parametrize("storage, package", list(STORAGE_DISTRIBUTIONS.items()))
def test_first_party_storage_not_installed(nothing_installed, storage, package):
    refused("model_cpu_offload", PluginNotInstalledError, f"pip install {package}", storage=storage)


def test_not_installed_mentions_disabled_autoload(nothing_installed, monkeypatch):
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    refused("model_cpu_offload_and_qfloat4", PluginNotInstalledError, AUTOLOAD_ENV)


def test_unknown_quantizer_and_storage(nothing_installed):
    refused("model_cpu_offload_and_qint3", UnknownModeError, "unknown quantizer 'qint3'")
    refused("model_cpu_offload", UnknownModeError, "unknown storage 'ssd'.*Installed storages: ram", storage="ssd")


def test_a_storage_for_a_placement_that_offloads_nothing_is_refused():
    refused("model_full_load", IncompatibleModeError, "storage='ram' would hold nothing", storage="ram")
