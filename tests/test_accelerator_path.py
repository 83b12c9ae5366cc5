"""The accelerator path end to end: prefetch on a side stream, events, ``record_stream``, page-locked staging.

Every test here is marked ``accelerator``: on a CUDA machine it runs on the GPU; in CI (no GPU) it runs on the
CPU under the strict model of asynchronous copies (``memmode_core.testing.StrictStreams``), where a copy that
is used before it is waited for leaves NaN in the output and a buffer released or overwritten too early is an
error after the test. Each lossless run is compared with full load bit for bit, and where the model runs, its
counters prove the asynchronous path was taken.
"""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from helpers import ACCELERATOR, assert_bit_equal, assert_same_tensors, on_accelerator, state_of
from tiny_loras import load_lora
from tiny_pipelines import full_load_outputs, make_pipeline, run, two_calls

pytestmark = [on_accelerator, pytest.mark.usefixtures("private_tmp")]

#: two experts (``transformer`` and ``transformer_2``), a text encoder and a VAE
FAMILY = "wan22"
#: every storage a streamed group can wait in on an accelerator (``pinned`` through its non-CUDA fallback
#: under the model)
STORAGES = ["ram", "pinned", "disk", "mmap"]
GROUPINGS = {
    "block1": {"offload_type": "block_level", "num_blocks_per_group": 1},
    "block2": {"offload_type": "block_level", "num_blocks_per_group": 2},
    "leaf": {"offload_type": "leaf_level"},
}


def assert_calls_equal(got, expected) -> None:
    for index, (g, e) in enumerate(zip(got, expected, strict=True), start=1):
        assert_bit_equal(g, e, f"call {index}")


def assert_async(strict_streams, storage: str | None = None) -> None:
    """Under the model: copies ran on a side stream and the compute stream waited for them (``ram``'s copies
    from pageable memory block the host instead, as CUDA's do)."""
    if strict_streams is None:
        return
    counts = strict_streams.counts
    assert counts["waits"] > 0 and counts["record_streams"] > 0, dict(counts)
    if storage != "ram":
        assert counts["async_copies"] > 0, dict(counts)


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("storage", STORAGES)
def test_prefetch_equals_full_load(storage, grouping, strict_streams):
    pipe = make_pipeline(FAMILY)
    before = state_of(pipe)
    handle = memmode.apply(
        pipe, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True, **GROUPINGS[grouping]
    )
    assert handle.runtime.moving.copy_stream is not None
    assert_calls_equal(two_calls(pipe, FAMILY), full_load_outputs(FAMILY))
    assert_async(strict_streams, storage)
    handle.remove()
    assert_same_tensors(state_of(pipe), before)


def _recorded_calls(pipe, names: tuple[str, ...]) -> list[tuple[str, tuple, dict]]:
    """The inputs each of ``names`` was called with during one pipeline call, in order."""
    calls = []
    hooks = [
        getattr(pipe, name).register_forward_pre_hook(
            lambda module, args, kwargs, name=name: calls.append((name, args, dict(kwargs))), with_kwargs=True
        )
        for name in names
    ]
    run(pipe, FAMILY)
    for hook in hooks:
        hook.remove()
    return calls


def _replay(pipe, calls) -> list[torch.Tensor]:
    with torch.no_grad():
        return [getattr(pipe, name)(*args, **kwargs)[0] for name, args, kwargs in calls]


@pytest.mark.parametrize("storage", ["pinned", "disk"])
def test_two_experts_called_alternately_equal_full_load(storage, strict_streams):
    """Wan 2.2 switches expert once per call; here the experts alternate at every step, so each one's recorded
    prefetch order is picked up again after the other has taken the device."""
    reference = make_pipeline(FAMILY)
    calls = _recorded_calls(reference, ("transformer", "transformer_2"))
    steps = [c for c in calls if c[0] == "transformer"][:2] + [c for c in calls if c[0] == "transformer_2"][:2]
    alternating = [steps[0], steps[2], steps[1], steps[3]] * 2
    expected = _replay(reference, alternating)
    pipe = make_pipeline(FAMILY)
    handle = memmode.apply(pipe, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True)
    for index, (got, want) in enumerate(zip(_replay(pipe, alternating), expected, strict=True)):
        assert_bit_equal(got, want, f"step {index} ({alternating[index][0]})")
    assert_async(strict_streams, storage)
    handle.remove()


@pytest.mark.parametrize("storage", STORAGES)
def test_component_offload_switching_components_equals_full_load(storage, strict_streams):
    """``model_cpu_offload`` onloads a whole component on the compute stream and offloads the idle ones when
    another needs the device; the copies from page-locked memory are asynchronous there too."""
    pipe = make_pipeline(FAMILY)
    handle = memmode.apply(pipe, "model_cpu_offload", device=ACCELERATOR, storage=storage)
    assert_calls_equal(two_calls(pipe, FAMILY), full_load_outputs(FAMILY))
    if strict_streams is not None:
        assert strict_streams.counts["copies"] > 0
    handle.remove()


class Interrupted(Exception):
    pass


def _interrupt_second_call(pipe) -> None:
    """Raise from inside the transformer's last block on the second pipeline call: the first call recorded
    the order, so the next group's prefetch is in flight when the call is abandoned."""
    armed = {"now": False}
    block = pipe.transformer.blocks[len(pipe.transformer.blocks) - 1]

    def interrupt(module, args):
        if armed["now"]:
            raise Interrupted

    hook = block.register_forward_pre_hook(interrupt)
    try:
        run(pipe, FAMILY)
        armed["now"] = True
        with pytest.raises(Interrupted):
            run(pipe, FAMILY)
    finally:
        hook.remove()


@pytest.mark.parametrize("storage", ["pinned", "disk"])
def test_remove_with_a_prefetch_in_flight_gives_back_every_weight(storage, strict_streams):
    pipe = make_pipeline(FAMILY)
    before = state_of(pipe)
    handle = memmode.apply(
        pipe, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True, offload_type="leaf_level"
    )
    _interrupt_second_call(pipe)
    handle.remove()
    assert_same_tensors(state_of(pipe), before)


@pytest.mark.parametrize("storage", ["pinned", "mmap"])
def test_apply_again_with_a_prefetch_in_flight_equals_full_load(storage, strict_streams):
    pipe = make_pipeline(FAMILY)
    memmode.apply(pipe, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True)
    _interrupt_second_call(pipe)
    handle = memmode.apply(
        pipe, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True, offload_type="leaf_level"
    )
    assert_calls_equal(two_calls(pipe, FAMILY), full_load_outputs(FAMILY))
    handle.remove()


def _lora_steps(pipe) -> list[torch.Tensor]:
    """Load an adapter, add a second one at half weight, fuse, unload: an output after each step."""
    outputs = []
    load_lora(pipe, FAMILY, "first", seed=1)
    outputs.append(run(pipe, FAMILY, 0))
    load_lora(pipe, FAMILY, "second", seed=2)
    pipe.set_adapters(["first", "second"], adapter_weights=[1.0, 0.5])
    outputs.append(run(pipe, FAMILY, 1))
    pipe.fuse_lora(components=["transformer", "transformer_2"])
    outputs.append(run(pipe, FAMILY, 2))
    pipe.unfuse_lora(components=["transformer", "transformer_2"])
    pipe.unload_lora_weights()
    outputs.append(run(pipe, FAMILY, 3))
    return outputs


@pytest.mark.parametrize("storage", ["pinned", "disk"])
def test_lora_hot_swap_under_prefetch_equals_full_load(storage, strict_streams):
    reference = make_pipeline(FAMILY)
    expected = _lora_steps(reference)
    pipe = make_pipeline(FAMILY)
    handle = memmode.apply(pipe, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True)
    assert_calls_equal(_lora_steps(pipe), expected)
    assert_async(strict_streams, storage)
    handle.remove()


def test_torch_compile_under_prefetch_equals_full_load(strict_streams):
    import torch._dynamo

    pipe = make_pipeline(FAMILY)
    handle = memmode.apply(pipe, "model_group_offload", device=ACCELERATOR, storage="pinned", use_stream=True)
    torch._dynamo.reset()
    pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    try:
        assert_calls_equal(two_calls(pipe, FAMILY), full_load_outputs(FAMILY))
        assert_async(strict_streams, "pinned")
    finally:
        torch._dynamo.reset()
    handle.remove()


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_load_into_prefetching_mode_equals_full_load(storage, tmp_path, strict_streams):
    """``load`` keeps groups in the checkpoint's own pages where it can (``in_place``) and streams them through
    the staging ring from there."""
    folder = tmp_path / "saved"
    make_pipeline(FAMILY).save_pretrained(folder)
    handle = memmode.load(folder, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True)
    pipe = handle.target
    pipe.set_progress_bar_config(disable=True)
    assert_calls_equal(two_calls(pipe, FAMILY), full_load_outputs(FAMILY))
    assert_async(strict_streams, storage)
    handle.remove()


def test_load_quantizes_each_layer_on_the_accelerator(tmp_path, strict_streams):
    """Loading into a quantized mode packs each weight on the accelerator (uploaded, packed there, its packed
    bytes brought back) and gives what quantizing after loading gives."""
    from diffusers import DiffusionPipeline

    folder = tmp_path / "saved"
    make_pipeline(FAMILY).save_pretrained(folder)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    memmode.apply(reference, "model_full_load_and_qfloat8", device=ACCELERATOR)
    expected = two_calls(reference, FAMILY)
    if strict_streams is not None:
        before = strict_streams.counts["to_host"]
    handle = memmode.load(folder, "model_group_offload_and_qfloat8", device=ACCELERATOR, storage="disk")
    if strict_streams is not None:
        assert strict_streams.counts["to_host"] > before, "the packed bytes came back from the device"
    pipe = handle.target
    pipe.set_progress_bar_config(disable=True)
    assert_calls_equal(two_calls(pipe, FAMILY), expected)
    handle.remove()
