"""LoRA under every mode: load, weight, fuse, unfuse, delete, unload — equal to the same sequence at full load.

What the placement x storage sweep covers (``_sweep``), on Wan 2.2 (two experts, LoRAs in both) and Flux
(a LoRA in the CLIP text encoder too):

* ``ram`` and ``poison``: every offloading placement on both families (``poison`` leaves NaN placeholders
  while offloaded: on a CPU-only machine it is what proves every group is onloaded, and every rebuilt
  group stored again, before it computes);
* ``disk`` and ``mmap``: ``model_cpu_offload`` and ``model_group_offload`` at block level on both families
  (every LoRA tensor of both, the CLIP LoRA included, goes through the files);
* ``disk`` and ``mmap`` with the other placements (leaf level and sequential, which rebuild hundreds of
  one-module files at every LoRA step and took 4-20 s per case on Wan 2.2 and Flux, and text-encoder
  offload): on a rotation (``ROTATION``), each of those six combinations on one family, spread over all
  five LoRA families: leaf level and sequential on LTX and QwenImage, text-encoder offload on Flux (its
  CLIP LoRA streamed from ``disk``) and SD3 (two CLIP LoRAs, ``mmap``).

``MEMMODE_TEST_FULL_MATRIX=1`` runs all 40 combinations on Wan 2.2 and Flux (and the rotation).  SD3,
QwenImage and LTX also run the sequence under leaf-level group offload with ``poison``.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import memmode_core as memmode
from helpers import (
    OFFLOADING_PLACEMENTS,
    STORAGES,
    TINY_PIPELINE_CALL,
    assert_reassociated,
    assert_same_outputs,
    full_matrix,
    hook_count,
    nbytes,
    placement_id,
)
from memmode_core.contracts.errors import IncompatibleModeError
from tiny_loras import LORA_FAMILIES, TEXT_ENCODER_LORA_COMPONENTS, load_lora, lora_components
from tiny_pipelines import full_load_outputs, make_pipeline, run

pytestmark = pytest.mark.usefixtures("poison_storage")


def lora_sequence(pipe, family: str) -> list[torch.Tensor]:
    """Two adapters loaded, weighted, fused, unfused, one deleted, all unloaded; an output after each step."""
    text_encoder = bool(TEXT_ENCODER_LORA_COMPONENTS[family])
    components = lora_components(family, text_encoder)
    outputs = []
    load_lora(pipe, family, "first", seed=1, text_encoder=text_encoder)
    outputs.append(run(pipe, family, 0))
    load_lora(pipe, family, "second", seed=2, text_encoder=text_encoder)
    pipe.set_adapters(["first", "second"], adapter_weights=[1.0, 0.5])
    outputs.append(run(pipe, family, 1))
    pipe.fuse_lora(components=components)
    outputs.append(run(pipe, family, 2))
    pipe.unfuse_lora(components=components)
    outputs.append(run(pipe, family, 3))
    pipe.delete_adapters("first")
    outputs.append(run(pipe, family, 4))
    pipe.unload_lora_weights()
    outputs.append(run(pipe, family, 5))
    return outputs


@functools.cache
def full_load_sequence(family: str) -> tuple[torch.Tensor, ...]:
    return tuple(lora_sequence(make_pipeline(family), family))


SWEPT_FAMILIES = ["flux", "wan22"]

#: The file storages with these placements run on one family each, spread over every LoRA family (see
#: ``_sweep``): the cheapest ones where the combination costs seconds, Flux (its CLIP LoRA streamed from
#: the files) and SD3 (two CLIP LoRAs) for text-encoder offload.
ROTATION = {
    ("model_group_offload-offload_type=leaf_level", "disk"): "ltx",
    ("model_group_offload-offload_type=leaf_level", "mmap"): "qwenimage",
    ("sequential_cpu_offload", "disk"): "qwenimage",
    ("sequential_cpu_offload", "mmap"): "ltx",
    ("text_encoder_offload", "disk"): "flux",
    ("text_encoder_offload", "mmap"): "sd3",
}


def _sweep() -> list:
    """``ram`` and ``poison`` with every placement, and the file storages with ``model_cpu_offload`` and
    block-level ``model_group_offload``, on both ``SWEPT_FAMILIES``: every LoRA tensor of both goes through
    the files.  The file storages with the other placements (leaf level and sequential rebuild hundreds of
    one-module files at every LoRA step) run on ``ROTATION``'s family; ``MEMMODE_TEST_FULL_MATRIX=1`` runs
    them on both ``SWEPT_FAMILIES`` too."""
    full = full_matrix()
    cases = [
        (family, mode, options, storage)
        for family in SWEPT_FAMILIES
        for mode, options in OFFLOADING_PLACEMENTS
        for storage in STORAGES
        if full or (placement_id((mode, options)), storage) not in ROTATION
    ]
    placements = {placement_id(p): p for p in OFFLOADING_PLACEMENTS}
    for (placement, storage), family in ROTATION.items():
        mode, options = placements[placement]
        if (family, mode, options, storage) not in cases:
            cases.append((family, mode, options, storage))
    return [pytest.param(*case, id=f"{case[0]}-{placement_id(case[1:3])}-{case[3]}") for case in cases]


def test_the_sweep_runs_every_combination_somewhere():
    """Each placement x storage runs on at least one family; ``ram`` and ``poison`` on both swept ones."""
    swept = {
        (family, placement_id((mode, options)), storage)
        for family, mode, options, storage in (case.values for case in _sweep())
    }
    for placement in map(placement_id, OFFLOADING_PLACEMENTS):
        for storage in STORAGES:
            families = {family for family, p, s in swept if (p, s) == (placement, storage)}
            assert families, f"{placement} x {storage} runs on no family"
            if storage in ("ram", "poison") or (placement, storage) not in ROTATION:
                assert families >= set(SWEPT_FAMILIES), (placement, storage)


@pytest.mark.parametrize("family, mode, options, storage", _sweep())
def test_lora_sequence_under_every_placement_and_storage(family, mode, options, storage, tmp_path):
    pipe = make_pipeline(family)
    extra = {"offload_dir": str(tmp_path)} if storage in ("disk", "mmap") else {}
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **extra, **options)
    assert_same_outputs(tuple(lora_sequence(pipe, family)), full_load_sequence(family))
    handle.remove()
    assert hook_count(pipe) == 0


@pytest.mark.parametrize("family", sorted(set(LORA_FAMILIES) - {"wan22", "flux"}))
def test_lora_sequence_on_the_other_families(family):
    pipe = make_pipeline(family)
    memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison", offload_type="leaf_level")
    assert_same_outputs(tuple(lora_sequence(pipe, family)), full_load_sequence(family))


def test_loading_an_adapter_stores_only_the_adapter():
    """A rebuild keeps every stored part whose tensors did not change."""
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison")
    session = handle.runtime.session
    before = dict(session.groups)
    load_lora(pipe, "flux", "first", seed=1)
    added = set(session.groups) - set(before)
    assert added and set(before) <= set(session.groups)  # nothing stored before was stored again
    adapter_bytes = nbytes(t for k in added for t in session.groups[k].values())
    lora = nbytes(p for n, p in pipe.transformer.named_parameters() if "lora_" in n)
    assert adapter_bytes == lora


def test_disk_files_follow_the_weights(tmp_path):
    """After a fuse, the fused groups are new files; the old ones are never read back as the new weights."""
    pipe = make_pipeline("flux")
    memmode.apply(pipe, "model_group_offload", device="cpu", storage="disk", offload_dir=str(tmp_path))
    load_lora(pipe, "flux", "first", seed=1)
    unfused = run(pipe, "flux", 0)
    files_before = set(os.listdir(tmp_path))
    pipe.fuse_lora(components=["transformer"])
    assert set(os.listdir(tmp_path)) - files_before  # fused weights were written
    fused = run(pipe, "flux", 0)
    assert_reassociated(fused, unfused, **TINY_PIPELINE_CALL)  # W + BA rounded once, against Wx + B(Ax)
    pipe.unfuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    # (W + BA) - BA is W rounded twice more: not the same operands as the full load's
    assert_reassociated(run(pipe, "flux", 0), full_load_outputs("flux")[0], **TINY_PIPELINE_CALL)


# -- quantized bases ---------------------------------------------------------------------------------------


def _quantized_lora_outputs(mode: str, **options) -> tuple[torch.Tensor, torch.Tensor]:
    pipe = make_pipeline("flux")
    memmode.apply(pipe, mode, device="cpu", **options)
    load_lora(pipe, "flux", "first", seed=1)
    return run(pipe, "flux", 0), pipe


@pytest.mark.parametrize("quantizer", ["qfloat8", "qfloat4"])
def test_lora_on_a_quantized_base_runs_unfused_and_fusing_is_refused(quantizer):
    expected, reference = _quantized_lora_outputs(f"model_full_load_and_{quantizer}")
    got, pipe = _quantized_lora_outputs(f"model_group_offload_and_{quantizer}", storage="poison")
    assert_same_outputs((got,), (expected,))
    plain = full_load_outputs("flux")[0]  # a fresh pipeline's call with seed 0
    assert (got - plain).abs().max() > 1e-3  # the adapter took effect on top of the quantized base
    for layer in pipe.transformer.modules():  # the adapter itself is not quantized
        if hasattr(layer, "lora_A") and "first" in layer.lora_A:
            assert layer.lora_A["first"].weight.dtype == torch.float32
    with pytest.raises(IncompatibleModeError, match="quantized"):
        pipe.fuse_lora(components=["transformer"])
    assert_same_outputs((run(pipe, "flux", 0),), (expected,))  # the refusal changed nothing
