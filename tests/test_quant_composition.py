"""Quantizers compose with every placement and storage: the output of model_full_load with the same
quantizer, and the ledger moves the quantized bytes.

The ``poison`` storage leaves NaN placeholders in offloaded parameters, so on a CPU-only machine a
quantized layer that computed before its packed tensors were onloaded would turn the output into
NaN (or, for NVFP4 nibbles, into different numbers): exact equality with full load proves that
every placement onloads the quantized tensors before use.
"""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from conftest import OFFLOADING_PLACEMENTS, assert_same_outputs, placement_id, requires_cuda, two_calls
from fakes import PoisonPlugin
from memmode_core import plugins
from tiny_pipelines import make_pipeline

QUANTIZERS = ["qfloat8", "qfloat4"]
PLACEMENTS = OFFLOADING_PLACEMENTS
#: storages that ship with memmode and can run on a CPU-only machine, when installed
FILE_STORAGES = ["disk", "mmap"]


def installed_storages() -> list[str]:
    plugins.reset()
    names = plugins.current().names("storage")
    plugins.reset()
    return ["ram", "poison"] + [name for name in FILE_STORAGES if name in names]


@pytest.fixture(autouse=True)
def poison_storage():
    with memmode.temporary_plugin(PoisonPlugin(), name="poison", distribution="tests"):
        yield


_FULL_LOAD: dict[tuple[str, str], tuple[tuple[torch.Tensor, torch.Tensor], dict]] = {}


def full_load(family: str, quantizer: str | None):
    """Calls 1 and 2 of a fresh bf16 pipeline under model_full_load (with ``quantizer``), and its report."""
    key = (family, quantizer)
    if key not in _FULL_LOAD:
        pipe = make_pipeline(family, dtype=torch.bfloat16)
        mode = "model_full_load" + (f"_and_{quantizer}" if quantizer else "")
        handle = memmode.apply(pipe, mode)
        _FULL_LOAD[key] = (two_calls(pipe, family), handle.report())
    return _FULL_LOAD[key]


def apply_and_run(family: str, mode: str, storage: str | None, options: dict, tmp_path):
    pipe = make_pipeline(family, dtype=torch.bfloat16)
    extra = dict(options)
    if storage in FILE_STORAGES:
        extra["offload_dir"] = str(tmp_path)
    handle = memmode.apply(pipe, mode, storage=storage, **extra)
    outputs = two_calls(pipe, family)
    report = handle.report()
    handle.remove()
    return outputs, report


def savings(report) -> int:
    """Bytes quantization took off the quantized components."""
    return sum(q["bytes_before"] - q["bytes_after"] for q in report.quantization.values())


def matrix() -> list[tuple[str, str]]:
    """Every storage on Wan 2.2 (two experts, a VAE with a feature cache); the strictest one, poison,
    on Flux (single- and dual-stream blocks, a modulation Linear in every block)."""
    return [("wan22", storage) for storage in installed_storages()] + [("flux", "poison")]


@pytest.mark.parametrize("family, storage", matrix(), ids=[f"{family}-{storage}" for family, storage in matrix()])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_every_placement_and_storage_gives_the_full_load_output(family, quantizer, placement, storage, tmp_path):
    name, options = placement
    expected, full_report = full_load(family, quantizer)
    outputs, report = apply_and_run(family, f"{name}_and_{quantizer}", storage, options, tmp_path)
    assert_same_outputs(outputs, expected, atol=0)
    assert report.quantization == full_report.quantization


@pytest.mark.parametrize("placement", [("model_full_load", {}), *PLACEMENTS], ids=placement_id)
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_the_ledger_moves_the_quantized_bytes(quantizer, placement, tmp_path):
    name, options = placement
    family = "wan22"
    storage = "ram" if name != "model_full_load" else None
    _, plain = apply_and_run(family, name, storage, options, tmp_path)
    _, quantized = apply_and_run(family, f"{name}_and_{quantizer}", storage, options, tmp_path)
    saved = savings(quantized)
    assert saved > 0
    moved_less = plain.bytes_transferred - quantized.bytes_transferred
    if name in ("model_full_load", "text_encoder_offload"):
        # the transformers are onloaded once, when the mode is applied, and stay
        assert plain.peak_device_bytes - quantized.peak_device_bytes == saved
        assert moved_less == saved
    elif name == "model_cpu_offload":
        # each transformer is onloaded once per pipeline call, whole
        assert moved_less == 2 * saved
        assert quantized.peak_device_bytes < plain.peak_device_bytes
    else:
        # streamed: every transformer weight moves at least once per call, at its quantized size
        assert moved_less >= 2 * saved
        if options.get("offload_type") == "block_level":
            assert quantized.peak_device_bytes < plain.peak_device_bytes
        else:  # one module at a time: the largest may be a (full-precision) text encoder or VAE layer
            assert quantized.peak_device_bytes <= plain.peak_device_bytes
    assert quantized.onloads == plain.onloads


@requires_cuda
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_prefetched_group_offload_on_cuda_gives_the_full_load_output(quantizer):
    """On CUDA the next group's packed tensors are copied on a side stream while the current one computes."""
    storage = "pinned" if "pinned" in plugins.current().names("storage") else "ram"
    reference = make_pipeline("wan22", dtype=torch.bfloat16)
    memmode.apply(reference, f"model_full_load_and_{quantizer}", device="cuda")
    expected = two_calls(reference, "wan22")
    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    handle = memmode.apply(pipe, f"model_group_offload_and_{quantizer}", device="cuda", storage=storage,
                           use_stream=True)
    assert_same_outputs(two_calls(pipe, "wan22"), expected)
    handle.remove()
