"""The strict model of asynchronous copies (``memmode_core.testing.StrictStreams``) and its teeth.

First the model's rules on their own, with the primitives called directly; then the engine with one of its
synchronisations removed — a wait, a ``record_stream``, a release fence — by dropping that one call at its
call site: the model must catch each, every time.
"""

from __future__ import annotations

import sys

import pytest
import torch

import memmode_core as memmode
from helpers import assert_bit_equal
from memmode_core.engine import streams as streams_layer
from memmode_core.engine.streams import installed
from memmode_core.testing import StrictStreams, StrictStreamsError
from tiny_pipelines import full_load_outputs, make_pipeline, two_calls

CPU = torch.device("cpu")


@pytest.fixture
def model():
    strict = StrictStreams(seed=0)
    with installed(strict):
        yield strict


def _side_copy(model, src, *, label="g"):
    side = model.new_stream(CPU)
    with model.on(side), model.label(label):
        dst = model.to_device(src, CPU, non_blocking=True)
        ready = model.new_event(CPU)
        model.record(ready)
    return side, dst, ready


# -- the rules ------------------------------------------------------------------------------------------------


def test_a_side_stream_copy_is_invisible_until_the_compute_stream_waits_for_it(model):
    src = torch.arange(6, dtype=torch.float32)
    side = model.new_stream(CPU)
    early = model.new_event(CPU)
    with model.on(side):
        model.record(early)  # before the copy: waiting on it lands nothing
        dst = model.to_device(src, CPU, non_blocking=True)
        ready = model.new_event(CPU)
        model.record(ready)
    assert dst.isnan().all()
    model.wait(model.current_stream(CPU), early)
    assert dst.isnan().all()
    model.wait(model.current_stream(CPU), ready)
    assert torch.equal(dst, src)


def test_integer_and_packed_buffers_hold_a_poison_pattern_until_the_copy_lands(model):
    packed = torch.arange(8, dtype=torch.uint8)
    codes = torch.arange(8, dtype=torch.int8)
    _, dst_packed, ready = _side_copy(model, packed)
    _, dst_codes, _ = _side_copy(model, codes)
    assert (dst_packed == 0xFF).all() and (dst_codes == -1).all()
    model.synchronize(CPU)
    assert torch.equal(dst_packed, packed) and torch.equal(dst_codes, codes)


def test_waits_are_transitive_through_other_streams(model):
    src = torch.randn(5)
    first, dst, ready = _side_copy(model, src)
    second = model.new_stream(CPU)
    model.wait(second, ready)
    relay = model.new_event(CPU)
    model.record(relay, second)
    model.wait(model.current_stream(CPU), relay)
    assert torch.equal(dst, src)


def test_copies_on_the_compute_stream_land_in_order_and_blocking_copies_before_returning(model):
    src = torch.randn(4)
    assert torch.equal(model.to_device(src, CPU, non_blocking=True), src)
    side = model.new_stream(CPU)
    with model.on(side):
        pending = model.to_device(src, CPU, non_blocking=True)
        blocking = model.to_device(src * 2, CPU)  # waits for the stream's earlier work too
    assert torch.equal(blocking, src * 2) and torch.equal(pending, src)


def test_landing_order_is_shuffled_between_streams_and_kept_within_one():
    finals = set()
    for seed in range(12):
        model = StrictStreams(seed=seed)
        dst = model.empty((1,), torch.float32, CPU)
        events = []
        for value in (1.0, 2.0):
            stream = model.new_stream(CPU)
            with model.on(stream):
                model.copy_(dst, torch.tensor([value]), non_blocking=True)
                model.copy_(dst, torch.tensor([value + 10]), non_blocking=True)  # lands after the first
                events.append(model.new_event(CPU))
                model.record(events[-1])
        model.synchronize(CPU)
        finals.add(dst.item())
    assert finals == {11.0, 12.0}, "either stream may land last, and each stream's second copy lands after its first"


def test_releasing_a_buffer_the_compute_stream_reads_needs_record_stream(model):
    src = torch.randn(16)
    _, dst, ready = _side_copy(model, src, label="block.3")
    model.wait(model.current_stream(CPU), ready)
    del dst
    with pytest.raises(StrictStreamsError, match=r"group 'block.3'.*record_stream"):
        model.synchronize(CPU)

    _, kept, ready = _side_copy(model, src)
    model.wait(model.current_stream(CPU), ready)
    model.record_stream(kept, model.current_stream(CPU))
    del kept
    _, synced, ready = _side_copy(model, src)
    model.wait(model.current_stream(CPU), ready)
    model.synchronize(CPU)
    del synced
    model.check()


def test_a_buffer_released_before_anything_read_it_is_fine_on_its_own_stream(model):
    _, dst, _ = _side_copy(model, torch.randn(16))
    del dst  # the allocator reuses it for work queued behind the copy on the same stream
    model.check()


def test_page_locked_memory_must_not_change_or_go_while_a_copy_reads_it(model):
    pinned = model.pinned_empty(64)
    pinned.fill_(7)
    _, dst, ready = _side_copy(model, pinned, label="block.1")
    assert not model.done(ready)
    pinned.fill_(9)  # the DMA may not have read it yet
    with pytest.raises(StrictStreamsError, match=r"group 'block.1'.*overwritten"):
        model.wait_host(ready)

    pinned = model.pinned_empty(64)
    _side_copy(model, pinned, label="block.2")
    del pinned
    with pytest.raises(StrictStreamsError, match=r"group 'block.2'.*released"):
        model.synchronize(CPU)

    pinned = model.pinned_empty(64)
    _, dst, ready = _side_copy(model, pinned)
    model.wait_host(ready)
    assert model.done(ready)
    pinned.fill_(1)  # the host knows the copy finished
    model.check()


def test_the_real_backend_on_the_cpu_has_no_streams():
    real = streams_layer.active()
    assert real.name == "torch" and not real.has_streams(CPU) and real.is_host(CPU) and not real.can_pin(CPU)


# -- teeth: the engine with one synchronisation removed ---------------------------------------------------------


def _without(model: StrictStreams, primitive: str, *callers: str) -> list:
    """Drop ``model.<primitive>`` calls made from the functions with these qualified names; the callers dropped."""
    original, dropped = getattr(model, primitive), []

    def maybe(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_qualname
        if caller in callers:
            dropped.append(caller)
            return None
        return original(*args, **kwargs)

    setattr(model, primitive, maybe)
    return dropped


def _run_prefetching(model: StrictStreams, storage: str, tmp_path) -> tuple:
    with installed(model):
        pipe = make_pipeline("wan22")
        files = {"offload_dir": tmp_path} if storage in ("disk", "mmap") else {}
        handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage=storage, use_stream=True, **files)
        outputs = two_calls(pipe, "wan22")
        handle.remove()
        model.check()
    return outputs


def test_without_defects_the_same_runs_are_clean_and_bit_equal(tmp_path):
    for storage in ("pinned", "disk"):
        outputs = _run_prefetching(StrictStreams(seed=3), storage, tmp_path / storage)
        for got, want in zip(outputs, full_load_outputs("wan22")):
            assert_bit_equal(got, want)


def test_a_missing_wait_shows_as_wrong_numbers(tmp_path):
    model = StrictStreams(seed=3)
    dropped = _without(model, "wait", "Moving.ensure")
    outputs = _run_prefetching(model, "pinned", tmp_path)
    assert dropped, "the engine waits for a prefetch in ensure()"
    assert any(torch.isnan(o).any() for o in outputs), "a prefetched group used before its copies landed"


#: (primitive, the engine's call sites it is dropped from, storage, the error the model gives)
DROPPED_FENCES = {
    "record_stream": ("record_stream", ("Moving.ensure",), "pinned", r"group '\w+/[^']+'.*record_stream"),
    "staging chunk reused": (
        "wait_host",
        ("StagingRing._take",),
        "disk",
        r"group '[^']+'.*page-locked host buffer was overwritten",
    ),
    # the slabs' own fence, and the synchronisations before it (end of call, remove) that would cover for it
    "slabs released": (
        "synchronize",
        ("_Pins.release", "Moving.synchronize"),
        "pinned",
        r"group '[^']+': a page-locked host buffer .* released while a copy",
    ),
}


@pytest.mark.parametrize("case", DROPPED_FENCES)
def test_a_missing_fence_is_an_error_naming_the_group(case, tmp_path):
    primitive, callers, storage, error = DROPPED_FENCES[case]
    model = StrictStreams(seed=3)
    dropped = _without(model, primitive, *callers)
    with pytest.raises(StrictStreamsError, match=error):
        _run_prefetching(model, storage, tmp_path)
    assert callers[0] in dropped, f"the engine calls {primitive} from {callers[0]}"
