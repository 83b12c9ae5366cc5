"""The streaming placements: every placement and offload type equals full load, call after call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memmode_core as memmode
from fake_plugins import PoisonSession
from helpers import (
    ACCELERATOR,
    OFFLOADING_PLACEMENTS,
    assert_bit_equal,
    assert_same_outputs,
    hook_count,
    on_accelerator,
    placement_id,
    requires_cuda,
    snapshot,
)
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.group_specs import Policy, block_groups
from memmode_core.engine.groups import claim_groups
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.runtime import Runtime
from tiny_models import make_tied
from tiny_pipelines import full_load_outputs, make_pipeline, run, two_calls

PLACEMENTS = [*OFFLOADING_PLACEMENTS, ("model_group_offload", {"num_blocks_per_group": 2})]

pytestmark = pytest.mark.usefixtures("poison_storage")


@pytest.mark.parametrize("storage", ["ram", "poison"])
@pytest.mark.parametrize("mode, options", PLACEMENTS, ids=[placement_id(p) for p in PLACEMENTS])
def test_every_placement_equals_full_load(family, mode, options, storage):
    pipe = make_pipeline(family)
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
    assert_same_outputs(two_calls(pipe, family), full_load_outputs(family))
    report = handle.report()
    assert report.onloads > 0 and report.bytes_transferred > 0
    handle.remove()
    assert hook_count(pipe) == 0
    assert_same_outputs((run(pipe, family, 0),), full_load_outputs(family)[:1])


def _peak(family: str, mode: str, **options) -> int:
    pipe = make_pipeline(family)
    handle = memmode.apply(pipe, mode, device="cpu", **options)
    run(pipe, family)
    peak = handle.report().peak_device_bytes
    handle.remove()
    return peak


def test_peaks_are_ordered_leaf_block_component_full(family):
    leaf = _peak(family, "model_group_offload", offload_type="leaf_level")
    block = _peak(family, "model_group_offload")
    component = _peak(family, "model_cpu_offload")
    full = _peak(family, "model_full_load")
    assert leaf < block < component < full


def test_sequential_keeps_small_tables_resident():
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "sequential_cpu_offload", device="cpu", storage="poison")
    resident = {slot.name for g in handle.runtime.groups if g.policy is Policy.RESIDENT for slot in g.slots}
    assert "transformer.scale_shift_table" in resident
    assert "transformer.blocks.0.scale_shift_table" in resident
    assert {"transformer.rope.freqs_cos", "transformer.rope.freqs_sin"} <= resident
    assert not any(".attn1.to_q.weight" in name for name in resident)
    assert_same_outputs(two_calls(pipe, "wan22"), full_load_outputs("wan22"))


def test_text_encoder_offload_streams_only_text_encoders():
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "text_encoder_offload", device="cpu", storage="poison")
    for group in handle.runtime.groups:
        expected = Policy.STREAM if group.component.startswith("text_encoder") else Policy.RESIDENT
        assert group.policy is expected, group
    assert_same_outputs(two_calls(pipe, "flux"), full_load_outputs("flux"))


def test_text_encoder_offload_needs_a_text_encoder():
    pipe = make_pipeline("wan22")
    with pytest.raises(IncompatibleModeError, match="has none"):
        memmode.apply(pipe.transformer, "text_encoder_offload", device="cpu")


def test_text_encoder_offload_refuses_an_fsdp_wrapped_encoder(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        pipe = make_pipeline("flux")
        fully_shard(pipe.text_encoder_2)
        with pytest.raises(IncompatibleModeError, match="FSDP-wrapped.*text_encoder_2|text_encoder_2.*FSDP"):
            memmode.apply(pipe, "text_encoder_offload", device="cpu")
        assert hook_count(pipe) == 0
    finally:
        dist.destroy_process_group()


# -- leaving components out of a placement ------------------------------------------------------------------


@pytest.mark.usefixtures("private_tmp")
@pytest.mark.parametrize("storage", ["poison", "disk"])
def test_excluded_components_are_left_where_they_are(storage):
    expected = run(make_pipeline("flux"), "flux", 0)
    pipe = make_pipeline("flux")
    vae_before = snapshot(pipe)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage=storage, unplaced=["vae", "text_encoder"])
    assert {g.component for g in handle.runtime.groups} == {"transformer", "text_encoder_2"}
    after = snapshot(pipe)
    for key, value in vae_before.items():
        if isinstance(key, tuple) and key[0] in ("vae", "text_encoder"):
            assert after[key] == value, key  # same tensors, same memory, no hooks, no handle
    assert_bit_equal(run(pipe, "flux", 0), expected)
    handle.remove()


def test_excluded_components_with_a_quantizer_and_with_auto(qint8):
    pipe = make_pipeline("flux")
    with pytest.raises(InvalidOptionError, match="no denoiser"):  # left out: not a default target either
        memmode.apply(pipe, "model_cpu_offload_and_qint8", device="cpu", unplaced=["transformer"])
    handle = memmode.apply(
        pipe,
        "model_cpu_offload_and_qint8",
        device="cpu",
        unplaced=["transformer"],
        components=["transformer"],
    )
    assert set(handle.quantized) == {"transformer"}  # named explicitly: quantized, but not placed
    assert "transformer" not in {g.component for g in handle.runtime.groups}
    handle.remove()
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "auto", device="cpu", unplaced=["vae"])
    assert "vae" not in {g.component for g in handle.runtime.groups}
    handle.remove()
    assert all(e.peak_device_bytes > 0 for e in memmode.plan(pipe, device="cpu", unplaced=["vae"]))


@pytest.mark.parametrize(
    "names, match",
    [
        (["nope"], "no module component named 'nope'"),
        (["vae", "transformer", "text_encoder", "text_encoder_2"], "leaves no component"),
        ([3], "string"),
    ],
)
def test_unplaced_refusals_are_typed_and_touch_nothing(names, match):
    pipe = make_pipeline("flux")
    before = snapshot(pipe)
    with pytest.raises(InvalidOptionError, match=match):
        memmode.apply(pipe, "model_group_offload", device="cpu", unplaced=names)
    assert snapshot(pipe) == before


def test_unplaced_on_a_bare_module_is_refused():
    target = make_tied("nested_tied")
    with pytest.raises(InvalidOptionError, match="bare module"):
        memmode.apply(target, "model_group_offload", device="cpu", unplaced=["module"])
    assert hook_count(target) == 0


@pytest.mark.parametrize("spelling", ["exclude_components", "exclude_modules"])
@pytest.mark.parametrize("entry", ["apply", "prepare", "plan"])
def test_the_old_and_the_diffusers_spelling_of_unplaced_are_refused_naming_it(entry, spelling):
    """``exclude_components=`` (memmode's earlier spelling) and ``exclude_modules=`` (diffusers') would otherwise
    be an unknown plugin option: each is refused, before anything is touched, with the spelling to use."""
    pipe = make_pipeline("flux")
    before = snapshot(pipe)
    call = {"apply": memmode.apply, "prepare": memmode.prepare, "plan": memmode.plan}[entry]
    args = (pipe,) if entry == "plan" else (pipe, "model_group_offload")
    with pytest.raises(InvalidOptionError, match=r"write unplaced=\['vae'\]"):
        call(*args, device="cpu", **{spelling: ["vae"]})
    assert snapshot(pipe) == before


def test_exclude_is_the_quantizers_and_naming_a_component_with_it_is_refused(qint8):
    """``exclude=`` takes layer-name fragments the quantizer keeps at full precision; a diffusers user who means
    "leave the VAE alone" and writes ``exclude=["vae"]`` would quantize exactly as without it. Refused, saying
    what each argument does."""
    pipe = make_pipeline("flux")
    before = snapshot(pipe)
    with pytest.raises(InvalidOptionError, match=r"names the component 'vae'.*unplaced=\['vae'\]"):
        memmode.apply(pipe, "model_cpu_offload_and_qint8", device="cpu", exclude=["vae"])
    with pytest.raises(InvalidOptionError, match="has no quantizer.*unplaced="):
        memmode.apply(pipe, "model_cpu_offload", device="cpu", exclude=["vae"])
    assert snapshot(pipe) == before


# -- execution order and prefetch, exercised on the CPU through the runtime -----------------------------


class Conditional(nn.Module):
    """Blocks run in an order chosen per call, and may be skipped: what prefetching must survive."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj_in = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4))
        self.order = [0, 1, 2, 3]

    def forward(self, x):
        x = self.proj_in(x)
        for index in self.order:
            x = x + self.blocks[index](x)
        return x


def _prefetching_runtime(model: nn.Module) -> tuple[Runtime, PoisonSession]:
    session = PoisonSession()
    runtime = Runtime(
        {"model": model},
        claim_groups({"model": model}, block_groups("model", model)),
        device=torch.device("cpu"),
        session=session,
        ledger=Ledger(),
        prefetch=True,
    )
    runtime.install()
    return runtime, session


def test_execution_order_is_recorded_on_the_first_call_and_prefetched_after():
    model = Conditional()
    x = torch.randn(2, 8)
    model.order = [3, 1, 0, 2]
    expected = model(x)
    runtime, _ = _prefetching_runtime(model)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    by_key = {g.key: g for g in runtime.groups}
    chain_ = [by_key["model/blocks.3"]]
    while chain_[-1].next is not None:
        chain_.append(chain_[-1].next)
    assert [g.key for g in chain_] == ["model/blocks.3", "model/blocks.1", "model/blocks.0", "model/blocks.2"]
    peaks = []
    for _ in range(2):
        runtime.ledger.reset_peak()
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        peaks.append(runtime.ledger.peak)
    block = by_key["model/blocks.0"].nbytes
    assert peaks[0] == by_key["model/<rest>"].nbytes + 2 * block  # current block + the prefetched next one
    assert runtime.ledger.resident == 0  # everything offloaded once the call returned
    runtime.remove()


def test_a_skipped_or_reordered_layer_never_uses_stale_or_missing_weights():
    model = Conditional()
    x = torch.randn(2, 8)
    runtime, _ = _prefetching_runtime(model)
    model(x)  # records 0, 1, 2, 3
    for order in ([0, 2, 3], [3, 2, 1, 0], [1], [0, 1, 2, 3]):
        model.order = order
        runtime.remove()
        expected = model(x)
        runtime, _ = _prefetching_runtime(model)
        model.order = [0, 1, 2, 3]
        model(x)
        model.order = order
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        assert runtime.ledger.resident == 0
    runtime.remove()


# -- the accelerator: streams and prefetch (CUDA, else the strict model on the CPU); peaks on CUDA only ------


@on_accelerator
@pytest.mark.parametrize("num_blocks_per_group", [1, 2])
def test_stream_prefetch_equals_full_load(num_blocks_per_group, strict_streams):
    family = "wan22"
    pipe = make_pipeline(family)
    handle = memmode.apply(
        pipe, "model_group_offload", device=ACCELERATOR, use_stream=True, num_blocks_per_group=num_blocks_per_group
    )
    assert handle.runtime.moving.copy_stream is not None
    reference = make_pipeline(family)
    memmode.apply(reference, "model_full_load", device=ACCELERATOR)
    expected = two_calls(reference, family)
    for got, want in zip(two_calls(pipe, family), expected):
        assert_bit_equal(got, want)
    for got, want in zip(two_calls(pipe, family), two_calls(reference, family)):
        assert_bit_equal(got, want)
    if strict_streams is not None:
        assert strict_streams.counts["async_copies"] > 0 and strict_streams.counts["waits"] > 0
    handle.remove()


@on_accelerator
def test_prefetch_survives_skipped_and_reordered_blocks(strict_streams):
    model = Conditional().to(ACCELERATOR)
    x = torch.randn(2, 8).to(ACCELERATOR)
    expected = {}
    for order in ([0, 1, 2, 3], [0, 2, 3], [3, 2, 1, 0], [1]):
        model.order = order
        expected[tuple(order)] = model(x)
    model = model.cpu()
    handle = memmode.apply(model, "model_group_offload", device=ACCELERATOR, use_stream=True)
    for order in ([0, 1, 2, 3], [0, 2, 3], [3, 2, 1, 0], [1], [0, 1, 2, 3]):
        model.order = order
        torch.testing.assert_close(model(x), expected[tuple(order)], rtol=0, atol=0)
    if strict_streams is not None:
        assert strict_streams.counts["async_copies"] > 0
    handle.remove()


@requires_cuda("the peaks are torch.cuda.max_memory_allocated, the caching allocator's own counter")
def test_cuda_peak_memory_ordering():
    results = {}
    for name, mode, options in [
        ("leaf", "model_group_offload", {"offload_type": "leaf_level"}),
        ("block", "model_group_offload", {}),
        ("component", "model_cpu_offload", {}),
        ("full", "model_full_load", {}),
    ]:
        pipe = make_pipeline("flux")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        handle = memmode.apply(pipe, mode, device="cuda", **options)
        run(pipe, "flux")
        results[name] = torch.cuda.max_memory_allocated() - base
        handle.remove()
    assert results["leaf"] < results["block"] < results["component"] < results["full"]
