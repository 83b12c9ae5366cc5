"""The planner's predictions against the ledger, auto's choices, and the errors of both."""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from helpers import assert_bit_equal
from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.targets import Target
from memmode_core.contracts.units import parse_byte_size
from memmode_core.planning.calls import default_calls
from memmode_core.planning.choosing import NoModeFitsError
from tiny_pipelines import make_pipeline, run


def _measured_sequence(family: str) -> list[str]:
    pipe = make_pipeline(family)
    handle = memmode.apply(pipe, "model_full_load", device="cpu")
    run(pipe, family)
    sequence = handle.report().call_sequence
    handle.remove()
    return sequence


def test_predictions_match_the_ledger_of_a_real_call(family):
    """Within 10% for every placement, from the same call sequence (steady state: the second call)."""
    sequence = _measured_sequence(family)
    pipe = make_pipeline(family)
    entries = memmode.plan(pipe, device="cpu", calls=sequence, storage="ram")
    assert {e.placement for e in entries} >= {
        "model_full_load",
        "model_cpu_offload",
        "model_group_offload",
        "sequential_cpu_offload",
        "text_encoder_offload",
    }
    for entry in entries:
        handle = memmode.apply(pipe, entry.placement, device="cpu", storage=entry.storage, **entry.options)
        run(pipe, family)
        handle.reset_stats()
        run(pipe, family)
        report = handle.report()
        handle.remove()
        assert report.peak_device_bytes == pytest.approx(entry.peak_device_bytes, rel=0.10), entry.label()
        assert report.bytes_transferred == pytest.approx(entry.transfer_bytes_per_call, rel=0.10, abs=1), entry.label()


def test_the_report_counts_component_calls_including_vae_decodes():
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu")
    run(pipe, "wan22")
    report = handle.report()
    assert report.component_calls == {"vae": 1, "text_encoder": 2, "transformer": 2, "transformer_2": 4}
    assert report.call_sequence[0] == "text_encoder" and report.call_sequence[-1] == "vae"
    assert report.resident_device_bytes == 0  # the VAE's groups left with its decode()


def test_quantized_predictions_match_the_ledger():
    sequence = _measured_sequence("flux")
    entries = memmode.plan(make_pipeline("flux"), device="cpu", calls=sequence, storage="ram", quantizer="qfloat8")
    plain = {
        (e.placement, tuple(e.options.items())): e
        for e in memmode.plan(make_pipeline("flux"), device="cpu", calls=sequence, storage="ram")
    }
    for entry in entries:
        assert entry.mode.endswith("_and_qfloat8")
        pipe = make_pipeline("flux")
        handle = memmode.apply(pipe, entry.mode, device="cpu", storage=entry.storage, **entry.options)
        run(pipe, "flux")
        handle.reset_stats()
        run(pipe, "flux")
        report = handle.report()
        assert report.peak_device_bytes == pytest.approx(entry.peak_device_bytes, rel=0.10), entry.label()
        assert report.bytes_transferred == pytest.approx(entry.transfer_bytes_per_call, rel=0.10, abs=1)
        unquantized = plain[(entry.placement, tuple(entry.options.items()))]
        if entry.placement == "text_encoder_offload":  # moves only the (unquantized) text encoders
            assert entry.transfer_bytes_per_call == unquantized.transfer_bytes_per_call
        elif unquantized.transfer_bytes_per_call:  # the quantized transformer moves fewer bytes
            assert entry.transfer_bytes_per_call < unquantized.transfer_bytes_per_call


def test_default_call_profile_splits_steps_between_denoisers():
    calls = default_calls(Target.of(make_pipeline("wan22")), steps=20)
    assert calls == {"vae": 1, "text_encoder": 1, "transformer": 10, "transformer_2": 10}
    assert default_calls(Target.of(torch.nn.Linear(2, 2)), steps=20) == {"module": 1}


def test_plan_refuses_unknown_components_in_calls():
    with pytest.raises(InvalidOptionError, match="no component"):
        memmode.plan(make_pipeline("flux"), device="cpu", calls={"unet": 3})


# -- auto ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget, expected",
    [
        (None, "model_full_load"),
        ("450KB", "model_cpu_offload"),
        ("130KB", "model_group_offload"),
        ("30KB", "model_group_offload"),
    ],
)
def test_auto_picks_the_fastest_mode_that_fits(budget, expected):
    pipe = make_pipeline("wan22")
    reference = run(make_pipeline("wan22"), "wan22")
    handle = memmode.apply(pipe, "auto", device="cpu", vram_budget=budget)
    assert handle.mode == expected and handle.requested_mode == "auto"
    assert_bit_equal(run(pipe, "wan22"), reference, f"auto ({handle.mode})")  # a lossless mode: like with like
    if budget is not None:
        limit = parse_byte_size(budget)
        assert handle.report().peak_device_bytes <= limit
    if budget == "30KB":
        assert handle.choice.options == {"offload_type": "leaf_level"}
    handle.remove()


def test_auto_with_a_quantizer_quantizes():
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "auto_and_qfloat8", device="cpu", vram_budget="300KB")
    assert handle.mode.endswith("_and_qfloat8") and handle.quantizer == "qfloat8"
    assert handle.report().quantization


def test_a_budget_nothing_fits_says_what_the_smallest_mode_needs():
    pipe = make_pipeline("wan22")
    with pytest.raises(NoModeFitsError, match=r"smallest, model_group_offload\[offload_type=leaf_level\].*needs"):
        memmode.apply(pipe, "auto", device="cpu", vram_budget="1KB")
    assert not hasattr(pipe.transformer, "_memmode_handle")


def test_auto_refuses_placement_options_it_chooses_itself():
    with pytest.raises(InvalidOptionError, match="offload_type"):
        memmode.apply(make_pipeline("flux"), "auto", device="cpu", offload_type="leaf_level")


def test_plan_marks_the_entry_auto_chooses():
    entries = memmode.plan(make_pipeline("ltx"), device="cpu", vram_budget="200KB", ram_budget="1GB")
    chosen = [e for e in entries if e.chosen]
    assert len(chosen) == 1 and chosen[0].fits and chosen[0].peak_device_bytes <= 200_000
    assert all(not e.fits and e.reason for e in entries if e.peak_device_bytes > 200_000)
    data = chosen[0].as_dict()
    assert {"mode", "storage", "peak_device_bytes", "transfer_bytes_per_call", "fits"} <= data.keys()


# -- ranks of one machine ------------------------------------------------------------------------------------


def test_ranks_of_one_machine_count_what_they_share_once_and_the_rest_once_each():
    """Four ranks each placing the pipeline: one GPU's device bytes as for one, and the machine's host memory:
    each rank's own copy under ram, one copy of the files under mmap and disk."""
    pipe = make_pipeline("wan22")
    one = {(e.label(), e.storage): e for e in memmode.plan(pipe, device="cpu")}
    four = {(e.label(), e.storage): e for e in memmode.plan(pipe, device="cpu", ranks=4)}
    assert one.keys() == four.keys()
    for key, entry in four.items():
        alone = one[key]
        assert entry.ranks == 4 and alone.ranks == 1
        assert entry.peak_device_bytes == alone.peak_device_bytes and entry.host_bytes == alone.host_bytes
        assert alone.machine_host_bytes == alone.host_bytes and alone.machine_disk_bytes == alone.disk_bytes
        if entry.storage in ("mmap", "disk"):
            assert entry.machine_disk_bytes == entry.disk_bytes > 0
        if entry.storage == "ram":
            assert entry.machine_host_bytes == 4 * entry.host_bytes > 0


def test_layers_the_ranks_pack_once_between_them_count_once():
    """With a quantizer and ``ram`` the ranks pack each component once into a file they all map: the machine holds
    one copy of the packed layers; unquantized, each rank's own."""
    pipe = make_pipeline("wan22")
    quantized = memmode.plan(pipe, device="cpu", ranks=4, storage="ram", quantizer="qfloat8")
    plain = memmode.plan(pipe, device="cpu", ranks=4, storage="ram")
    assert quantized and all(e.machine_host_bytes == e.host_bytes for e in quantized if e.storage == "ram")
    assert any(e.machine_host_bytes == 4 * e.host_bytes > 0 for e in plain if e.storage == "ram")


def test_the_ram_budget_is_the_machines_and_auto_chooses_for_its_ranks():
    pipe = make_pipeline("wan22")
    ram_entry = next(e for e in memmode.plan(pipe, device="cpu", storage="ram") if e.mode == "model_cpu_offload")
    budget = 2 * ram_entry.host_bytes  # enough for one or two ranks' own copies, not for four
    four = memmode.plan(pipe, device="cpu", ranks=4, ram_budget=budget)
    assert all(not e.fits for e in four if e.storage == "ram")
    assert any("for the machine's 4 ranks" in (e.reason or "") for e in four)
    assert any(e.fits for e in four if e.storage == "mmap")
    prepared = memmode.prepare(pipe, "auto", device="cpu", ranks=4, ram_budget=budget)
    assert prepared.storage in ("mmap", "disk") and prepared.choice.ranks == 4


def test_context_parallel_ranks_share_the_transformers_activations():
    """Each of the ranks splitting the sequence holds its share of the transformer's activations (a component
    diffusers can split: one with a ``_cp_plan``); the others keep theirs whole."""
    from diffusers import WanTransformer3DModel

    from memmode_core.planning.calls import CallTrace

    pipe = make_pipeline("wan22")
    assert getattr(WanTransformer3DModel, "_cp_plan", None) is not None
    shapes = {"height": 32, "width": 32, "num_frames": 9}
    whole = CallTrace.of(pipe, ["transformer"], torch.device("cpu"), shapes)
    split = CallTrace.of(pipe, ["transformer"], torch.device("cpu"), shapes, context_parallel=4)
    assert split.activation_bytes == -(-whole.activation_bytes // 4)
    vae = CallTrace.of(pipe, ["vae"], torch.device("cpu"), shapes, context_parallel=4)
    assert vae.activation_bytes == whole.traces["vae"].activation_peak


@pytest.mark.parametrize("keyword", ["ranks", "context_parallel"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_a_count_of_ranks_must_be_a_whole_number(keyword, value):
    with pytest.raises(InvalidOptionError, match=keyword):
        memmode.plan(make_pipeline("flux"), device="cpu", **{keyword: value})
