"""The ``pinned`` storage: exact-size packing and the bounded mode (pure planning, tested everywhere),
refusal without an accelerator, page-locked copies on the accelerator (CUDA, else the CPU under the strict
model of asynchronous copies), the slabs' registration with the CUDA runtime faked, and what only real CUDA
shows (``is_pinned()`` after ``cudaHostRegister``)."""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from helpers import ACCELERATOR, HAS_CUDA, assert_bit_equal, assert_same_outputs, nbytes, on_accelerator, requires_cuda
from memmode_core import InvalidOptionError, StorageUnavailableError
from memmode_core.engine import streams
from memmode_storage_pinned.slabs import GROUP_ALIGNMENT, PAGE, Spot, assign_spots, round_up
from memmode_storage_pinned.storage import PinnedStorage
from tiny_pipelines import full_load_outputs, make_pipeline, two_calls

requires_no_accelerator = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="checks the refusal on a machine without an accelerator"
)
MiB = 1 << 20


# -- planning: exact sizes, bounded --------------------------------------------------------------------


def test_groups_are_packed_back_to_back_into_exactly_sized_slabs():
    sizes = {"a": 3 * MiB + 1, "b": 5 * MiB, "c": 100, "d": 0}
    spots, slabs = assign_spots(sizes, limit=None, slab_bytes=64 * MiB)
    assert spots == {
        "a": Spot(0, 0),
        "b": Spot(0, round_up(3 * MiB + 1, GROUP_ALIGNMENT)),
        "c": Spot(0, round_up(3 * MiB + 1, GROUP_ALIGNMENT) + 5 * MiB),
        "d": None,
    }
    assert slabs == [round_up(8 * MiB + 64 + 100, PAGE)]
    assert slabs[0] - sum(sizes.values()) < PAGE + 2 * GROUP_ALIGNMENT  # vs pin_memory(): 4 + 8 + 4 KiB blocks


def test_a_group_larger_than_a_slab_gets_a_slab_of_its_own_size():
    spots, slabs = assign_spots({"small": MiB, "huge": 300 * MiB, "next": MiB}, limit=None, slab_bytes=256 * MiB)
    assert spots == {"small": Spot(0, 0), "huge": Spot(1, 0), "next": Spot(2, 0)}
    assert slabs == [MiB, 300 * MiB, MiB]


def test_the_limit_bounds_what_is_pinned_and_the_rest_stays_pageable():
    sizes = {"a": 40 * MiB, "b": 40 * MiB, "c": 40 * MiB, "d": 10 * MiB}
    spots, slabs = assign_spots(sizes, limit=90 * MiB, slab_bytes=64 * MiB)
    assert sum(slabs) <= 90 * MiB
    assert spots["a"] is not None and spots["b"] is not None
    assert spots["c"] is None, "beyond the limit: pageable"
    assert spots["d"] is not None, "a later, smaller group still fits under the limit"
    assert assign_spots(sizes, limit=0)[1] == []


def test_pinned_options_are_a_size_and_whether_ranks_share():
    option, share = PinnedStorage.options.declarations()
    assert option.name == "pinned_limit" and option.default is None
    assert share.name == "share_between_ranks" and share.default is True and share.validate(False) is False
    assert option.validate("24GiB") == 24 << 30 and option.validate(1000) == 1000
    with pytest.raises(InvalidOptionError, match="pinned_limit"):
        option.validate("lots")


# -- without an accelerator: unavailable, and said so ----------------------------------------------------

NO_ACCELERATOR = "no accelerator with streams"


@requires_no_accelerator
def test_without_an_accelerator_pinned_is_listed_as_unavailable_with_the_reason():
    (row,) = [r for r in memmode.list_plugins() if r.kind == "storage" and r.name == "pinned"]
    assert row.distribution == "memmode-storage-pinned" and row.version
    assert not row.available and NO_ACCELERATOR in row.reason


@requires_no_accelerator
def test_without_an_accelerator_asking_for_pinned_raises_and_touches_nothing():
    pipe = make_pipeline("flux")
    with pytest.raises(StorageUnavailableError, match=f"pinned.*{NO_ACCELERATOR}"):
        memmode.apply(pipe, "model_group_offload", storage="pinned")
    assert memmode.remove(pipe) is False
    assert_same_outputs(two_calls(pipe, "flux"), full_load_outputs("flux"))


@on_accelerator
def test_pinned_is_available_for_the_accelerator_only():
    storage = PinnedStorage()
    assert storage.unavailable_reason() is None and storage.unavailable_reason(torch.device(ACCELERATOR)) is None
    # a device copies cannot overlap with: the CPU on CUDA; under the model the CPU is the accelerator
    other = torch.device("cpu") if HAS_CUDA else torch.device("meta")
    assert f"compute device is {other}" in storage.unavailable_reason(other)


# -- on the accelerator ---------------------------------------------------------------------------------


def _in_a_slab(tensor: torch.Tensor, slabs) -> bool:
    return any(s.tensor.data_ptr() <= tensor.data_ptr() < s.tensor.data_ptr() + s.nbytes for s in slabs)


@on_accelerator
def test_the_offloaded_copies_are_in_exactly_sized_slabs_and_copied_asynchronously(strict_streams):
    pipe = make_pipeline("wan22")
    reference = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_group_offload", device=ACCELERATOR, storage="pinned")
    offloaded = [p for name in ("transformer", "transformer_2") for p in pipe.components[name].parameters()]
    session = handle.runtime.session
    assert all(_in_a_slab(p, session._pins.slabs) for p in offloaded), "at rest in the page-locked slabs"
    stats = handle.report().storage_bytes
    pinned_groups = [g for g in handle.runtime.groups if session._pins.spots.get(g.key) is not None]
    total = sum(g.nbytes for g in pinned_groups)
    slack = len(session._pins.slabs) * PAGE + len(pinned_groups) * GROUP_ALIGNMENT
    assert total > 0 and total <= stats["pinned_bytes"] < total + slack, "exact sizes, not powers of two"
    assert stats["pageable_bytes"] == 0
    memmode.apply(reference, "model_full_load", device=ACCELERATOR)
    for got, want in zip(two_calls(pipe, "wan22"), two_calls(reference, "wan22")):
        assert_bit_equal(got, want)
    if strict_streams is not None:
        assert strict_streams.counts["pinned_copies"] > 0 and strict_streams.counts["async_copies"] > 0
    slabs = session._pins.slabs
    handle.remove()
    assert all(p.device.type == "cpu" for p in offloaded)
    assert not any(slab.registered for slab in slabs), "back in ordinary (pageable) memory"
    if strict_streams is not None:
        assert strict_streams.counts["registered"] == len(slabs), "each slab page-locked in place, once"
        assert not strict_streams._pinned, "every registration undone at remove"


@requires_cuda("is_pinned() reports the page-locking done by cudaHostRegister and undone by cudaHostUnregister")
def test_cuda_the_offloaded_copies_are_page_locked_and_unlocked_at_remove():
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_group_offload", device="cuda", storage="pinned")
    offloaded = [p for name in ("transformer", "transformer_2") for p in pipe.components[name].parameters()]
    assert all(p.is_pinned() for p in offloaded)
    handle.remove()
    assert not any(p.is_pinned() for p in offloaded), "unregistered at remove"
    assert all(p.device.type == "cpu" for p in offloaded)


@on_accelerator
def test_pinned_limit_keeps_the_rest_pageable(strict_streams):
    pipe = make_pipeline("wan22")
    limit = 64 << 10
    handle = memmode.apply(pipe, "model_group_offload", device=ACCELERATOR, storage="pinned", pinned_limit=limit)
    stats = handle.report().storage_bytes
    assert 0 < stats["pinned_bytes"] <= limit and stats["pageable_bytes"] > 0
    reference = make_pipeline("wan22")
    memmode.apply(reference, "model_full_load", device=ACCELERATOR)
    for got, want in zip(two_calls(pipe, "wan22"), two_calls(reference, "wan22")):
        assert_bit_equal(got, want)
    if strict_streams is not None:
        assert strict_streams.counts["pinned_copies"] > 0
    handle.remove()


# -- the session's bookkeeping for a CUDA device, with the CUDA runtime faked (registration is its only CUDA call) --

CUDA = torch.device("cuda")


class FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr, size, flags):
        assert ptr % PAGE == 0 and ptr not in self.registered and flags == 1
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0


@pytest.fixture
def fake(monkeypatch) -> FakeCudart:
    """CUDA's runtime, faked: the real stream layer's page-locking in place, seen call by call."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "check_error", lambda code: None if code == 0 else pytest.fail(str(code)))
    monkeypatch.setattr(streams.active(), "synchronize", lambda device: None)
    monkeypatch.setattr(streams.active(), "can_register_host", lambda device: True)
    return cudart


def test_session_packs_copies_reuses_and_unlocks(fake):
    from memmode_storage_pinned.storage import PinnedSession

    g = torch.Generator().manual_seed(0)
    groups = {
        "a": {
            "w": torch.randn(300, 7, generator=g),
            "b": torch.randn(3, generator=g).half(),
            "i": torch.arange(5),
            "m": torch.tensor(True),
            "e": torch.empty(0, 2),
        },
        "b": {"w": torch.randn(1000, generator=g).to(torch.bfloat16)},
        "c": {"w": torch.randn(4096, generator=g)},
    }
    sizes = {k: nbytes(v.values()) for k, v in groups.items()}
    session = PinnedSession(CUDA, limit=round_up(sizes["a"] + 64 + sizes["b"], PAGE))
    session.reserve(sizes)
    assert len(fake.registered) == 1, "a and b share one slab; c is beyond the limit"
    rest = {key: session.put(key, tensors) for key, tensors in groups.items()}
    slab = session._pins.slabs[0].tensor
    for key, tensors in groups.items():
        for name, tensor in tensors.items():
            assert torch.equal(rest[key][name], tensor), (key, name)
            in_slab = slab.data_ptr() <= rest[key][name].data_ptr() < slab.data_ptr() + slab.numel()
            assert in_slab == (key != "c") or tensor.numel() == 0, (key, name)
        fetched = session.fetch(key, torch.device("cpu"))
        assert all(torch.equal(fetched[n], t) for n, t in tensors.items())
        assert session.restore(key) is rest[key]
    stats = session.stats()
    assert stats == {"pinned_bytes": sum(fake.registered.values()), "pageable_bytes": sizes["c"]}
    with pytest.raises(KeyError, match="not reserved"):
        session.put("unknown", {"w": torch.zeros(1)})
    session.reserve({"a@2": 64})  # a part stored later (an adapter's weights): the limit is already used
    assert session._pins.spots["a@2"] is None and len(fake.registered) == 1
    session.close()
    assert fake.registered == {}, "every slab unlocked at close"
    assert torch.equal(rest["a"]["w"], groups["a"]["w"]), "views handed out stay valid as ordinary memory"
    session.close()  # idempotent


def test_later_reservations_add_slabs_without_moving_earlier_groups(fake):
    from memmode_storage_pinned.storage import PinnedSession

    session = PinnedSession(CUDA, limit=None)
    session.reserve({"g": 4096})
    first = session.put("g", {"w": torch.arange(1024, dtype=torch.float32)})
    session.reserve({"g@1": 64})
    later = session.put("g@1", {"w": torch.ones(16)})
    assert len(fake.registered) == 2 and session._pins.spots["g@1"].slab == 1
    assert torch.equal(first["w"], torch.arange(1024, dtype=torch.float32)) and torch.equal(later["w"], torch.ones(16))
    session.discard("g@1")
    assert session.stats()["pinned_bytes"] == 2 * PAGE
    session.close()
    assert fake.registered == {}
