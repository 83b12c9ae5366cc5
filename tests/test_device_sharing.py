"""One device, many handles: the shared room, the reserve, another application, and out-of-memory recovery.

Under the strict model of an accelerator with a capacity (``StrictStreams(total_memory=...)``: every device buffer
counts while it lives, and going over raises ``torch.OutOfMemoryError``, the accelerator's own type), with real
tiny models and a real tiny Wan 2.2 pipeline: two handles on one device never take it over its size and both stay
exact; memory another application takes between calls gives a smaller residency and no error; an out-of-memory
error injected at an onload is recovered from and the output is bit-equal; a call that cannot fit is a typed error
naming its component, and no weight is lost; the reserve is kept free; the bandwidth probe never takes more than a
share of what is free.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import memmode_core as memmode
from helpers import assert_bit_equal
from memmode_core.cli.run_command import room_lines
from memmode_core.cli.runner import run_modes
from memmode_core.engine.host_pins import HostPins, host_memory, host_pins
from memmode_core.engine.streams import installed
from memmode_core.handle import handle_of
from memmode_core.planning.measuring import measured_bandwidth
from memmode_core.testing import StrictStreams
from tiny_models import make_blocks, make_inputs
from tiny_pipelines import full_load_outputs, make_pipeline, run

CPU = torch.device("cpu")
#: blocks of the tiny models (more than the default, so that a part of them can stay)
BLOCKS = 8


def strict_device(total: int, seed: int = 0) -> StrictStreams:
    return StrictStreams(seed=seed, total_memory=total)


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in module.state_dict().values())


def keep_everything(model: torch.nn.Module, storage: str = "ram", **options) -> memmode.Handle:
    """Group offload keeping every group of ``model`` on the device (its budget is its size)."""
    return memmode.apply(
        model, "model_group_offload", device="cpu", storage=storage, vram_budget=weight_bytes(model), **options
    )


@contextlib.contextmanager
def wan_after_its_first_call():
    """The tiny Wan 2.2 pipeline under group offload keeping its experts' groups (``vram_budget`` covers them), on a
    strict device of 1 GiB installed for the block, after a first call checked bit-equal: ``(strict, pipe, handle,
    expected)``, ``expected`` the full load's two calls."""
    expected = full_load_outputs("wan22")
    pipe = make_pipeline("wan22")
    strict = strict_device(1 << 30)
    with installed(strict):
        handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="ram", vram_budget="1GiB")
        assert_bit_equal(run(pipe, "wan22", 0), expected[0], "call 1")
        yield strict, pipe, handle, expected


@pytest.fixture
def blocks():
    """Two different tiny models, an input, and what each computes without memmode."""
    first, second = make_blocks(1, n=BLOCKS), make_blocks(2, n=BLOCKS)
    (x,) = make_inputs(1)
    with torch.no_grad():
        return first, second, x, (first(x), second(x))


# -- two handles on one device ----------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_two_handles_on_one_device_take_turns_and_never_exceed_it(blocks, storage, tmp_path):
    """Each handle alone fits and keeps all its groups; both together do not. Called in turn, the one not running
    gives back what it keeps, least recently used first; the device never holds more than its size, both stay
    exact, and each report says who gave what back for whom."""
    first, second, x, expected = blocks
    size = weight_bytes(first)
    strict = strict_device(size * 3 // 2)
    files = {"offload_dir": tmp_path} if storage == "disk" else {}
    with installed(strict), torch.no_grad():
        one = keep_everything(first, storage, **({"offload_dir": tmp_path / "1"} if files else {}))
        two = keep_everything(second, storage, **({"offload_dir": tmp_path / "2"} if files else {}))
        for _ in range(3):
            assert_bit_equal(first(x), expected[0], "first model")
            assert_bit_equal(second(x), expected[1], "second model")
        first_report, second_report = one.report(), two.report()
        one.remove()
        two.remove()
        strict.check()
    assert strict.capacity.refused == 0, "no allocation went over: room was made before each call"
    assert strict.capacity.peak_used <= strict.capacity.total
    assert first_report.peak_device_bytes == size, "alone on the device in its call, each keeps everything"
    gave = [e for e in first_report.evictions if e["by"] == "Blocks" and e["for"] == "Blocks #2"]
    took = [e for e in second_report.evictions if e["by"] == "Blocks" and e["for"] == "Blocks #2"]
    assert gave and took, (first_report.evictions, second_report.evictions)
    assert gave[0]["bytes"] == size and gave[0]["groups"] == BLOCKS


def test_a_handle_that_fits_beside_the_other_keeps_its_groups(blocks):
    """Room enough for both: nothing is given back, nothing moves again after the first calls."""
    first, second, x, expected = blocks
    strict = strict_device(weight_bytes(first) * 3)
    with installed(strict), torch.no_grad():
        one, two = keep_everything(first), keep_everything(second)
        first(x), second(x)
        one.reset_stats()
        two.reset_stats()
        assert_bit_equal(first(x), expected[0])
        assert_bit_equal(second(x), expected[1])
        assert one.report().onloads == two.report().onloads == 0
        assert not one.report().evictions and not two.report().evictions
        one.remove()
        two.remove()
        strict.check()


def test_two_threads_with_a_handle_each_share_the_device_exactly(blocks):
    """Two threads, each calling its own model (each keeping all its blocks), on a device with room for one and a
    half: a handle whose lock the other thread holds is never asked to give back (it is running), so neither waits
    for the other; the device never goes over, and every output is exact."""
    first, second, x, expected = blocks
    strict = strict_device(weight_bytes(first) * 3 // 2)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(model, want) -> None:
        try:
            barrier.wait()
            with torch.no_grad():
                for _ in range(20):
                    assert_bit_equal(model(x), want)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with installed(strict):
        handles = [keep_everything(first), keep_everything(second)]
        threads = [threading.Thread(target=work, args=pair) for pair in ((first, expected[0]), (second, expected[1]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
        for handle in handles:
            handle.remove()
        strict.check()
    assert not errors, errors
    assert strict.capacity.peak_used <= strict.capacity.total


def test_the_predicted_activations_of_a_call_get_their_room_before_it_runs(blocks):
    """Where the plan predicted a component's activations (``auto`` given the call's shapes), its weights leave them
    room: the call's weights stay under the free memory less its activations, the rest of its kept groups stream.
    (The strict model computes on the host, so the activations are counted here, not allocated.)"""
    first, _, x, expected = blocks
    size = weight_bytes(first)
    activations = size // 2
    strict = strict_device(size)
    with installed(strict), torch.no_grad():
        handle = keep_everything(first)
        handle.runtime.room.activations = {"module": activations}
        for _ in range(3):
            assert_bit_equal(first(x), expected[0])
        handle.remove()
        strict.check()
    assert 0 < strict.capacity.peak_used <= size - activations


def test_auto_given_the_call_shapes_hands_each_component_its_predicted_activations():
    pipe = make_pipeline("wan22")
    strict = strict_device(1 << 30)
    with installed(strict):
        handle = memmode.apply(pipe, "auto", device="cpu", height=16, width=16, num_frames=5)
        traces = handle.prepared.internal.request.traces
        assert handle.runtime.room.activations == {name: t.activation_peak for name, t in traces.items()}
        assert all(handle.runtime.room.activations[name] > 0 for name in ("transformer", "vae"))
        handle.remove()
        strict.check()


# -- another application ------------------------------------------------------------------------------------------


def test_memory_another_application_takes_between_calls_gives_a_smaller_residency_and_no_error():
    """A Wan 2.2 pipeline keeps its experts' groups (vram_budget covers them); between its calls another application
    takes most of the device. The next call reads the free memory again before each component runs and keeps fewer
    groups (the rest stream): no out-of-memory error, even caught, and the output is bit-equal."""
    with wan_after_its_first_call() as (strict, pipe, handle, expected):
        alone = handle.report().peak_device_bytes
        assert strict.capacity.peak_used == alone
        strict.capacity.occupy(strict.capacity.total - alone * 3 // 4)
        handle.reset_stats()
        assert_bit_equal(run(pipe, "wan22", 1), expected[1], "call 2")
        report = handle.report()
        handle.remove()
        strict.check()
    assert strict.capacity.refused == 0
    assert strict.capacity.peak_used <= strict.capacity.total
    assert report.peak_device_bytes <= alone * 3 // 4 < alone
    assert report.evictions and not report.recoveries


def test_a_room_smaller_than_the_kept_groups_keeps_most_of_them(blocks):
    """A model that keeps its eight blocks between calls, on a device that has room for six: at each forward the
    blocks enter in the same order, and those that leave for room are the ones needed again last, so only a
    couple move per forward (letting the oldest leave first would move all eight, every forward)."""
    first, _, x, expected = blocks
    size = weight_bytes(first)
    strict = strict_device(size * 6 // BLOCKS + 64)
    with installed(strict), torch.no_grad():
        handle = keep_everything(first)
        assert_bit_equal(first(x), expected[0])
        handle.reset_stats()
        for _ in range(4):
            assert_bit_equal(first(x), expected[0])
        onloads = handle.report().onloads
        handle.remove()
        strict.check()
    assert strict.capacity.refused == 0 and strict.capacity.peak_used <= strict.capacity.total
    assert onloads <= 4 * 2, f"{onloads} onloads in 4 forwards of 8 blocks, 6 of which fit"


def test_the_reserve_is_kept_free(blocks):
    """``reserve=`` (bytes or a share of the device) is never taken by memmode: the groups that do not fit beside it
    stream."""
    first, _, x, expected = blocks
    size = weight_bytes(first)
    strict = strict_device(size * 2)
    with installed(strict), torch.no_grad():
        handle = keep_everything(first, reserve=size * 5 // 4)
        assert_bit_equal(first(x), expected[0])
        assert_bit_equal(first(x), expected[0])
        handle.remove()
        strict.check()
    assert strict.capacity.peak_used <= strict.capacity.total - size * 5 // 4
    assert strict.capacity.refused == 0


@pytest.mark.parametrize("reserve", ["10%", 0.1])
def test_a_reserve_given_as_a_share_of_the_device(blocks, reserve):
    first, _, x, expected = blocks
    size = weight_bytes(first)
    strict = strict_device(size * 10 // 9)  # a tenth kept back leaves exactly the model's size
    with installed(strict), torch.no_grad():
        handle = keep_everything(first, reserve=reserve)
        assert_bit_equal(first(x), expected[0])
        handle.remove()
        strict.check()
    assert strict.capacity.peak_used <= strict.capacity.total - int(strict.capacity.total * 0.1)


@pytest.mark.parametrize("reserve", ["lots", "150%", -1, True, [1]])
def test_an_invalid_reserve_is_refused_before_anything_is_touched(blocks, reserve):
    first, _, _, _ = blocks
    with pytest.raises(memmode.InvalidOptionError, match="reserve="):
        memmode.apply(first, "model_group_offload", device="cpu", reserve=reserve)
    assert not memmode.hooks_of(first) and handle_of(first) is None


# -- out of memory at run time ------------------------------------------------------------------------------------


def test_an_out_of_memory_error_at_an_onload_is_recovered_and_the_output_is_bit_equal(blocks):
    """The device refuses an onload (a shape nobody planned, fragmentation): memmode releases what is not needed
    now — here the other handle's kept groups — tries once more, and says so in ``report()``."""
    first, second, x, expected = blocks
    strict = strict_device(weight_bytes(first) * 3)
    with installed(strict), torch.no_grad():
        one, two = keep_everything(first), keep_everything(second)
        assert_bit_equal(first(x), expected[0])
        strict.capacity.fail_allocations(1)
        assert_bit_equal(second(x), expected[1])
        recoveries, gave = two.report().recoveries, one.report().evictions
        one.remove()
        two.remove()
        strict.check()
    assert strict.capacity.refused == 1
    assert len(recoveries) == 1 and recoveries[0]["component"] == "module"
    assert recoveries[0]["released"] >= weight_bytes(first), "the idle handle's kept groups were released"
    assert "out of memory" in recoveries[0]["error"]
    assert gave and "ran out of memory" in gave[-1]["why"]


def test_a_pipeline_call_recovers_from_an_out_of_memory_error_in_the_middle():
    with wan_after_its_first_call() as (strict, pipe, handle, expected):
        strict.capacity.fail_allocations(1)
        assert_bit_equal(run(pipe, "wan22", 1), expected[1], "call 2, one onload refused")
        assert len(handle.report().recoveries) == 1
        handle.remove()
        strict.check()


def test_a_call_that_cannot_fit_is_a_typed_error_naming_its_component_and_no_weight_is_lost(blocks):
    """A device smaller than one group: the first onload fails twice (before and after releasing everything), and
    the error says which component, what it was planned to hold and what it held; the stored copies are intact:
    ``remove()`` gives every weight back, and the model computes exactly as before."""
    first, _, x, expected = blocks
    before = {name: t.clone() for name, t in first.state_dict().items()}
    strict = strict_device(1024)
    with installed(strict), torch.no_grad():
        handle = memmode.apply(first, "model_group_offload", device="cpu", storage="ram")
        with pytest.raises(memmode.DeviceMemoryError, match=r"component 'module' does not fit on cpu") as caught:
            first(x)
        handle.remove()
        strict.check()
    error = caught.value
    assert isinstance(error.__cause__, torch.OutOfMemoryError)
    assert (error.component, error.device) == ("module", "cpu")
    assert error.actual > error.free and error.predicted > 0
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    with torch.no_grad():
        assert_bit_equal(first(x), expected[0])


def test_a_call_refused_twice_raises_then_the_next_call_runs(blocks):
    """Both tries of one onload refused: the typed error; the handle is still usable, and exact, afterwards."""
    first, _, x, expected = blocks
    strict = strict_device(weight_bytes(first) * 3)
    with installed(strict), torch.no_grad():
        handle = memmode.apply(first, "model_group_offload", device="cpu", storage="ram")
        strict.capacity.fail_allocations(2)
        with pytest.raises(memmode.DeviceMemoryError):
            first(x)
        assert_bit_equal(first(x), expected[0])
        handle.remove()
        strict.check()


def test_memmode_run_says_what_left_the_device_for_whom():
    """``run`` (what ``memmode run`` measures) keeps each call's evictions and recoveries, and prints them: here the
    reserve leaves the Wan pipeline's experts less room than they keep."""
    strict = strict_device(1 << 20)
    with installed(strict):
        (result,) = run_modes(
            lambda: make_pipeline("wan22"),
            lambda pipe, callback=None: run(pipe, "wan22", 0),
            ["model_group_offload"],
            device="cpu",
            storage="ram",
            steps=1,
            progress=False,
            apply_options={"vram_budget": "1GiB", "reserve": (1 << 20) - (120 << 10)},
        )
        strict.check()
    assert result.evictions and not result.recoveries
    lines = room_lines([result])
    assert lines and all(line.startswith("model_group_offload: ") for line in lines)
    assert "of WanPipeline left the device for a call of 'transformer" in "\n".join(lines)


# -- planning with a reserve --------------------------------------------------------------------------------------


def test_plan_and_auto_leave_the_reserve_out_of_the_budget_they_derive():
    """Without a ``vram_budget``, ``plan(reserve=)`` judges against the free memory less the reserve — exactly as if
    that budget were given — and ``auto`` takes the reserve off the budget it derives."""
    pipe = make_pipeline("wan22")
    strict = strict_device(1 << 20)
    with installed(strict):
        free = strict.free_memory(CPU)
        given = memmode.plan(pipe, device="cpu", vram_budget=free - (600 << 10))
        reserved = memmode.plan(pipe, device="cpu", reserve=600 << 10)
        assert [(e.label(), e.storage, e.fits, e.chosen) for e in reserved] == [
            (e.label(), e.storage, e.fits, e.chosen) for e in given
        ]
        assert any(not e.fits for e in reserved), "the reserve makes a difference here"
        handle = memmode.apply(pipe, "auto", device="cpu", reserve=600 << 10)
        chosen = handle.prepared.choice
        assert chosen.peak_device_bytes <= int((free - (600 << 10)) * 0.8)
        handle.remove()
        strict.check()
    with pytest.raises(memmode.InvalidOptionError, match="reserve="):
        memmode.plan(pipe, device="cpu", reserve="half")


def test_memmode_plan_takes_a_reserve(capsys):
    from memmode_core.cli import main

    assert main(["plan", "--reserve", "10%", "--json"]) == 0
    assert '"entries"' in capsys.readouterr().out


# -- page-locked host memory --------------------------------------------------------------------------------------


@pytest.fixture
def pinned_budget():
    """``set(nbytes)``: the process may page-lock ``nbytes`` more than it holds locked when the test starts (what
    earlier tests of this process still hold: a live session's staging chunks), and ``locked()``: what the test
    itself holds locked now; the budget is put back after."""
    saved, before = host_pins.budget, host_pins.pinned

    class Budget:
        def set(self, nbytes: int) -> None:
            host_pins.budget = before + nbytes

        def locked(self) -> int:
            return host_pins.pinned - before

    yield Budget()
    host_pins.budget = saved


def test_page_locked_memory_never_exceeds_the_host_budget(blocks, pinned_budget, caplog):
    """Two handles under ``pinned`` with a host budget of 60% of one model: what does not fit in it stays in pageable
    memory, with a warning; the page-locked bytes never pass the budget, both models stay exact, and removing them
    gives every locked byte back."""
    first, second, x, expected = blocks
    size = weight_bytes(first)
    pinned_budget.set(size * 6 // 10)
    strict = strict_device(size * 4)
    with installed(strict), torch.no_grad(), caplog.at_level("WARNING", logger="memmode"):
        one = memmode.apply(first, "model_group_offload", device="cpu", storage="pinned")
        locked_by_one = pinned_budget.locked()
        two = memmode.apply(second, "model_group_offload", device="cpu", storage="pinned")
        assert 0 < locked_by_one <= size * 6 // 10 and pinned_budget.locked() <= size * 6 // 10
        assert strict.pinned_bytes == pinned_budget.locked(), "the budget counts exactly what is page-locked"
        stats = one.report().storage_bytes
        assert stats["pinned_bytes"] == locked_by_one and stats["pageable_bytes"] > 0
        assert_bit_equal(first(x), expected[0])
        assert_bit_equal(second(x), expected[1])
        one.remove()
        two.remove()
        strict.check()
    assert pinned_budget.locked() == 0 and strict.pinned_bytes == 0
    assert any(
        "in pageable memory" in r.getMessage() and "MEMMODE_PINNED_BUDGET" in r.getMessage() for r in caplog.records
    )


def test_a_file_storage_stages_through_ordinary_memory_when_the_budget_is_spent(
    blocks, pinned_budget, caplog, tmp_path
):
    """``disk`` uploads through two page-locked staging chunks; with no page-locked budget left they are ordinary
    memory (copies synchronous), said once, and the output is the same."""
    first, _, x, expected = blocks
    pinned_budget.set(0)
    strict = strict_device(weight_bytes(first) * 4)
    with installed(strict), torch.no_grad(), caplog.at_level("WARNING", logger="memmode"):
        handle = memmode.apply(first, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path)
        assert_bit_equal(first(x), expected[0])
        assert strict.pinned_bytes == 0 and pinned_budget.locked() == 0
        handle.remove()
        strict.check()
    assert sum("staging buffers" in r.getMessage() for r in caplog.records) == 1


def test_the_page_locked_budget_comes_from_the_environment_or_the_host(monkeypatch):
    monkeypatch.setenv("MEMMODE_PINNED_BUDGET", "3MiB")
    assert HostPins().budget == 3 << 20
    monkeypatch.setenv("MEMMODE_PINNED_BUDGET", "plenty")
    with pytest.raises(ValueError, match="MEMMODE_PINNED_BUDGET='plenty'"):
        _ = HostPins().budget
    monkeypatch.delenv("MEMMODE_PINNED_BUDGET")
    memory = host_memory()
    assert memory is None or HostPins().budget == int(memory * 0.5)


def test_a_full_load_makes_room_from_an_idle_handle_and_one_that_cannot_fit_leaves_the_model_as_it_was(blocks):
    """``model_full_load`` onloads everything at ``apply``: on a device another handle's kept groups fill, the idle
    handle gives them back and the full load fits; on a device too small for it, ``apply`` raises the typed error,
    and the model is as it was: its own weights, no hooks, nothing left on the device."""
    first, second, x, expected = blocks
    size = weight_bytes(first)
    strict = strict_device(size * 3 // 2)
    with installed(strict), torch.no_grad():
        one = keep_everything(first)
        assert_bit_equal(first(x), expected[0])
        full = memmode.apply(second, "model_full_load", device="cpu")
        assert_bit_equal(second(x), expected[1])
        assert_bit_equal(first(x), expected[0], "the kept model, streaming in what the full load leaves")
        assert one.report().evictions and full.report().recoveries
        full.remove()
        one.remove()
        strict.check()
    assert strict.capacity.peak_used <= strict.capacity.total

    before = {name: t.clone() for name, t in second.state_dict().items()}
    small = strict_device(size // 2)
    with installed(small), torch.no_grad():
        with pytest.raises(memmode.DeviceMemoryError, match="component 'module' does not fit"):
            memmode.apply(second, "model_full_load", device="cpu")
        assert not memmode.hooks_of(second) and handle_of(second) is None
        for name, tensor in second.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        assert small.capacity.used == 0, "what went to the device came back"
        small.check()


# -- what memmode itself allocates -----------------------------------------------------------------------------


def test_the_bandwidth_probe_takes_at_most_a_quarter_of_what_is_free():
    small = strict_device(32 << 20)
    with installed(small):
        measured_bandwidth(small, CPU, "pageable")
    assert small.capacity.peak_used == 0, "under 64 MiB free, the declared bandwidth is taken, nothing allocated"
    large = strict_device(400 << 20)
    with installed(large):
        assert measured_bandwidth(large, CPU, "pageable") > 0
    assert 0 < large.capacity.peak_used <= 100 << 20
