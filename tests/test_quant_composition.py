"""Quantizers compose with every placement and storage: the output of model_full_load with the same
quantizer, and the ledger moves the quantized bytes.

The ``poison`` storage leaves NaN placeholders in offloaded parameters, so on a CPU-only machine a
quantized layer that computed before its packed tensors were onloaded would turn the output into
NaN (or, for NVFP4 nibbles, into different numbers): exact equality with full load proves that
every placement onloads the quantized tensors before use.

What the placement x storage x quantizer sweep covers (``cases``):

* Wan 2.2 (two experts, a VAE with a feature cache): ``ram`` and ``poison`` with every placement and both
  quantizers; ``disk`` and ``mmap`` with ``model_cpu_offload`` and block-level ``model_group_offload`` and
  both quantizers (every packed tensor of both formats goes through the files);
* the file storages with the other placements (leaf level, sequential, text-encoder offload) on a rotation
  over the two quantizers: each of those six combinations with one quantizer, each quantizer with both
  storages (``_ROTATION``);
* Flux (single- and dual-stream blocks, a modulation Linear in every block): ``poison``, the strictest,
  with every placement and both quantizers.

``MEMMODE_TEST_FULL_MATRIX=1`` runs the file storages with every placement and both quantizers.
"""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from helpers import (
    ACCELERATOR,
    FILE_STORAGES,
    OFFLOADING_PLACEMENTS,
    assert_bit_equal,
    assert_same_outputs,
    full_matrix,
    on_accelerator,
    placement_id,
)
from memmode_core.discovery import plugins
from tiny_pipelines import make_pipeline, two_calls

QUANTIZERS = ["qfloat8", "qfloat4"]
PLACEMENTS = OFFLOADING_PLACEMENTS


def installed_storages() -> list[str]:
    plugins.reset()
    names = plugins.current().names("storage")
    plugins.reset()
    return ["ram", "poison"] + [name for name in FILE_STORAGES if name in names]


pytestmark = pytest.mark.usefixtures("poison_storage")


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


#: The file storages with these placements run with one quantizer each: ``qfloat8`` with the first of each
#: pair, ``qfloat4`` with the second (see ``cases``).
_ROTATION = [
    ("model_group_offload-offload_type=leaf_level", "disk"),
    ("model_group_offload-offload_type=leaf_level", "mmap"),
    ("sequential_cpu_offload", "mmap"),
    ("sequential_cpu_offload", "disk"),
    ("text_encoder_offload", "disk"),
    ("text_encoder_offload", "mmap"),
]


def _covered(quantizer: str, placement: str, storage: str) -> bool:
    if (placement, storage) not in _ROTATION or full_matrix():
        return True
    return _ROTATION.index((placement, storage)) % len(QUANTIZERS) == QUANTIZERS.index(quantizer)


def cases() -> list:
    """Every installed storage on Wan 2.2, the file storages' slow placements on a rotation over the
    quantizers; the strictest storage, poison, on Flux (see the module docstring)."""
    families = [("wan22", storage) for storage in installed_storages()] + [("flux", "poison")]
    return [
        pytest.param(
            quantizer, placement, family, storage, id=f"{quantizer}-{placement_id(placement)}-{family}-{storage}"
        )
        for quantizer in QUANTIZERS
        for placement in PLACEMENTS
        for family, storage in families
        if _covered(quantizer, placement_id(placement), storage)
    ]


def test_the_rotation_runs_every_combination_somewhere():
    swept = {
        (placement_id(placement), storage, quantizer)
        for quantizer, placement, _, storage in (case.values for case in cases())
    }
    for placement in map(placement_id, PLACEMENTS):
        for storage in installed_storages():
            quantizers = {q for p, s, q in swept if (p, s) == (placement, storage)}
            assert quantizers, f"{placement} x {storage} runs with no quantizer"
            if (placement, storage) not in _ROTATION:
                assert quantizers == set(QUANTIZERS), (placement, storage)


@pytest.mark.parametrize("quantizer, placement, family, storage", cases())
def test_every_placement_and_storage_gives_the_full_load_output(family, quantizer, placement, storage, tmp_path):
    name, options = placement
    expected, full_report = full_load(family, quantizer)
    outputs, report = apply_and_run(family, f"{name}_and_{quantizer}", storage, options, tmp_path)
    assert_same_outputs(outputs, expected)
    assert report.quantization == full_report.quantization


_PLAIN: dict[str, object] = {}


def _plain_report(placement, tmp_path):
    """The report of Wan 2.2 under ``placement`` without a quantizer (the same for both quantizers)."""
    name, options = placement
    key = placement_id(placement)
    if key not in _PLAIN:
        _PLAIN[key] = apply_and_run("wan22", name, "ram" if name != "model_full_load" else None, options, tmp_path)[1]
    return _PLAIN[key]


@pytest.mark.parametrize("placement", [("model_full_load", {}), *PLACEMENTS], ids=placement_id)
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_the_ledger_moves_the_quantized_bytes(quantizer, placement, tmp_path):
    name, options = placement
    family = "wan22"
    storage = "ram" if name != "model_full_load" else None
    plain = _plain_report(placement, tmp_path)
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


@on_accelerator
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_prefetched_group_offload_on_the_accelerator_gives_the_full_load_output(quantizer, strict_streams):
    """On the accelerator (CUDA, else the strict model) the next group's packed tensors are copied on a side
    stream while the current one computes."""
    storage = "pinned" if "pinned" in plugins.current().names("storage") else "ram"
    reference = make_pipeline("wan22", dtype=torch.bfloat16)
    memmode.apply(reference, f"model_full_load_and_{quantizer}", device=ACCELERATOR)
    expected = two_calls(reference, "wan22")
    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    handle = memmode.apply(
        pipe, f"model_group_offload_and_{quantizer}", device=ACCELERATOR, storage=storage, use_stream=True
    )
    for index, (got, want) in enumerate(zip(two_calls(pipe, "wan22"), expected), start=1):
        assert_bit_equal(got, want, f"call {index}")
    if strict_streams is not None:
        assert strict_streams.counts["async_copies"] > 0
    handle.remove()
