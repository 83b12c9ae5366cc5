"""diffusers' offloading tests, ported to memmode: what they protect must hold for memmode's modes too.

Sources (huggingface/diffusers, the versions in the stored index):

- ``tests/hooks/test_group_offloading.py`` (``GroupOffloadTests``, with the standalone-layer,
  nested-container and VAE-like cases of its newer revision);
- the offloading cases of the model tester mixin (``tests/models/test_modeling_common.py``,
  ``tests/models/testing_utils/memory.py``: ``test_group_offloading*``, ``test_cpu_offload``,
  ``test_disk_offload_*``);
- the offloading cases of the pipeline tester mixin (``tests/pipelines/test_pipelines_common.py``,
  ``tests/pipelines/testing_utils/memory.py``: ``test_sequential_cpu_offload_forward_pass``,
  ``test_model_cpu_offload_forward_pass``, ``test_*_offload_forward_pass_twice``,
  ``test_group_offloading_inference``, ``test_pipeline_level_group_offloading_*``).

Mapping: ``enable_group_offload`` / ``apply_group_offloading(onload_device, offload_type=...,
num_blocks_per_group=..., use_stream=...)`` is ``memmode.apply(target, "model_group_offload",
device=..., offload_type=..., num_blocks_per_group=..., use_stream=...)``; ``offload_to_disk_path``
is ``storage="disk"`` / ``"mmap"`` with ``offload_dir``; ``enable_model_cpu_offload`` and
``enable_sequential_cpu_offload`` are the ``model_cpu_offload`` and ``sequential_cpu_offload``
placements; diffusers' ``ValueError`` refusals are ``MemmodeError`` subclasses, raised before anything
is changed (checked: weights, hooks and outputs are as before).

How it is stricter than upstream: upstream compares with ``atol=1e-5``; memmode's placements are
lossless, so outputs are compared bit for bit with a fresh un-offloaded model (``torch.equal``). On a
CPU, where onloading from the ``ram`` storage changes no data, every case also runs under the test
``poison`` storage (``fake_plugins.PoisonStorage``: NaN placeholders while offloaded), which proves each
group is onloaded before it computes, and under ``disk`` and ``mmap``, which read real files. The
accelerator-only upstream cases (streams, ``record_stream``) are ported as the same tests on
``helpers.ACCELERATOR`` (``pinned`` storage and prefetch streams included): on CUDA where there is one,
else on the CPU under the strict model of asynchronous copies (``memmode_core.testing.StrictStreams``),
where a copy not waited for leaves NaN and a buffer released too early is an error. Only what needs
CUDA's own allocator counters (accelerator memory) still needs a CUDA device.

Not ported, because memmode differs by design:

- Hook-registry checks (``module._diffusers_hook.get_hook("group_offloading")``, the
  ``lazy_prefetch_group_offloading`` hook and its ``execution_order``, accelerate's ``CpuOffload`` /
  ``AlignDevicesHook`` types): memmode wraps ``forward`` instead of registering hooks. The tests check
  memmode's equivalent instead: its wrappers are installed, and none is left after ``remove()``.
- Sequential offload moving weights to the ``meta`` device: memmode leaves placeholders with the
  right shape, dtype and device (checked under ``poison``), and buffers keep their values at rest.
- ``model_cpu_offload`` offloading every component at the end of a pipeline call
  (``maybe_free_model_hooks``): memmode keeps the last component called resident until another
  component needs the device (docs/placements.md); the port checks every other component is at rest.
- ``pin_groups`` ("first_last", "all", callables) and errors raised from a pin callable during the
  forward: memmode has no pinning option (it prefetches the next group instead); an unknown or invalid
  option is refused at ``apply`` — that part is ported.
- ``non_blocking=True`` and ``record_stream=`` options: memmode decides both itself (async copies
  from the ``pinned`` storage on the prefetch stream, every prefetched tensor ``record_stream``-ed);
  the upstream variants collapse into the accelerator stream tests.
- The warning logged when a group-offloaded model or pipeline is moved with ``.to(accelerator)``:
  memmode logs nothing there (it notices the moved tensors at the next call); no equivalent to test.
- ``exclude_modules`` moving the excluded component to the onload device: memmode's
  ``unplaced`` leaves it exactly where the user put it (docs/placements.md); the port moves
  it itself and checks it is left alone.
- The error for disk offload without an offload folder (``test_disk_offload_without_safetensors``):
  memmode's file storages default to a private temporary folder and always write safetensors; the
  port checks that default instead.
- ``test_pipeline_with_accelerator_device_map`` and the accelerate ``device_map="auto"`` splits of
  ``test_cpu_offload`` / ``test_disk_offload_with_safetensors``: loading with a device map is not a
  memmode feature; the behaviour they protect (a model partly off the device computes the same) is
  ported with memmode's offloading placements and file storages.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import memmode_core as memmode
from diffusers_port_models import (
    BlockModel,
    NestedContainerModel,
    NormTailModel,
    ReorderedBlockModel,
    SinglePipeline,
    StandaloneLayersModel,
    forward,
    model_inputs,
    tiny_autoencoder,
    tiny_flux_transformer,
    tiny_wan_transformer,
)
from helpers import (
    ACCELERATOR,
    FILE_STORAGES,
    STORAGES,
    assert_bit_equal,
    assert_same_tensors,
    hook_count,
    module_components,
    on_accelerator,
    requires_cuda,
    snapshot,
    state_of,
)
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError, MemmodeError
from memmode_core.contracts.group_specs import Policy, block_groups
from memmode_core.contracts.storage import is_placeholder
from memmode_core.engine.hooks import MARKER
from tiny_components import seeded
from tiny_pipelines import full_load_outputs, make_pipeline, run

#: storages that leave a placeholder in every offloaded parameter: resting weights are visible
PLACEHOLDER_STORAGES = {"poison", "disk"}

#: storages on the accelerator, where prefetch streams are on: pageable and page-locked copies, and files read
#: through the staging ring (a group not onloaded is a device mismatch on CUDA, and under the strict model a
#: device copy reads NaN until it is waited for; ``poison`` adds NaN placeholders at rest)
ACCELERATOR_STORAGES = ["ram", "poison", "pinned", "disk", "mmap"]
#: the storages whose copies come from pageable memory: they block the host, as CUDA's do (no async copy)
PAGEABLE = {"ram", "poison"}


def places(cpu=STORAGES, accelerator=ACCELERATOR_STORAGES) -> list:
    """``(device, storage)`` parameters: ``cpu`` storages on the CPU, ``accelerator`` ones on ``ACCELERATOR``
    (CUDA, or the CPU under the strict model of asynchronous copies)."""
    return [pytest.param("cpu", s, id=f"cpu-{s}") for s in cpu] + [
        pytest.param(ACCELERATOR, s, id=f"accel-{s}", marks=on_accelerator) for s in accelerator
    ]


PLACES = places()

BLOCK = {"offload_type": "block_level", "num_blocks_per_group": 1}
LEAF = {"offload_type": "leaf_level"}

#: the poison storage, and file storages given no ``offload_dir`` writing under each test's folder
pytestmark = pytest.mark.usefixtures("poison_storage", "private_tmp")


def place(target, mode: str, device: str, storage: str, tmp_path, **options) -> memmode.Handle:
    where = {"offload_dir": str(tmp_path / "offload")} if storage in FILE_STORAGES else {}
    return memmode.apply(target, mode, device=device, storage=storage, **where, **options)


#: outputs of un-offloaded models and pipelines, computed once per session
_REFERENCES: dict[tuple, object] = {}


def reference(factory: Callable[[], nn.Module], device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """The output of a fresh, un-offloaded model: what every lossless mode must give, bit for bit."""
    key = (factory, device, seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = forward(seeded(factory).to(device), seed, device=device)
    return _REFERENCES[key]


def assert_prefetched(strict_streams, storage: str, streamed: bool = True) -> None:
    """Under the strict model (no-op on real CUDA or off the accelerator): whether the prefetch ran on a side
    stream — the compute stream waited for its copies and each prefetched tensor was ``record_stream``-ed — with
    its copies asynchronous, from page-locked memory, for every storage but the ``PAGEABLE`` ones (their copies
    block the host, as they do on CUDA)."""
    if strict_streams is None:
        return
    counts = strict_streams.counts
    if not streamed:
        assert counts["waits"] == counts["async_copies"] == 0, f"streams used: {dict(counts)}"
        return
    assert counts["waits"] > 0 and counts["record_streams"] > 0, f"no prefetch on a side stream: {dict(counts)}"
    if storage not in PAGEABLE:
        assert counts["async_copies"] > 0, f"no asynchronous copy: {dict(counts)}"


def onloaded_groups(handle: memmode.Handle) -> list[str]:
    """Groups that stream, yet hold their device copy: between calls there must be none. Unlike
    :func:`resting_weights`, this holds for every storage and on every device, the CPU under the strict model
    of asynchronous copies included (where device and host tensors both live on the ``cpu`` device)."""
    return [g.key for g in handle.runtime.groups if g.policy is not Policy.RESIDENT and g.resident]


def resting_weights(module: nn.Module, handle: memmode.Handle) -> list[str]:
    """Parameters holding real values between calls, other than those the placement keeps resident
    on purpose (sequential offload's small RoPE / modulation tables) and those every storage keeps readable
    at rest (a model's own loose parameters, which pipelines read outside any forward). Under a placeholder
    storage an offloaded component has none; it must have placeholders, or there is nothing to check."""
    kept = {
        id(slot.tensor)
        for g in handle.runtime.groups
        for slot in g.slots
        if g.policy is Policy.RESIDENT or slot.name in g.readable
    }
    assert any(is_placeholder(p) for p in module.parameters()), f"{type(module).__name__} holds no placeholder"
    return [
        name for name, p in module.named_parameters() if p.numel() > 1 and not is_placeholder(p) and id(p) not in kept
    ]


def assert_untouched(target, before: dict, weights: dict[str, torch.Tensor]) -> None:
    """After a refusal: no handle, no wrapper, the same tensors with the same values."""
    assert memmode.remove(target) is False, "a refused apply left a mode applied"
    assert snapshot(target) == before
    assert_same_tensors(state_of(target), weights)


def active_wrappers(module: nn.Module) -> list[str]:
    """memmode wrappers that still act: where another library wrapped a method on top of memmode's,
    ``remove()`` may leave memmode's in place as a pass-through (memmode_core.engine.hooks)."""
    found = []
    for name, sub in module.named_modules():
        for attr, fn in vars(sub).items():
            wrapper = getattr(fn, MARKER, None)
            if wrapper is not None and wrapper.active:
                found.append(f"{name or '<root>'}.{attr}")
    return found


# -- tests/hooks/test_group_offloading.py ----------------------------------------------------------


FORWARD_PASS_OPTIONS = {
    "block3": {"offload_type": "block_level", "num_blocks_per_group": 3},
    "block1": BLOCK,
    "leaf": LEAF,
}


def _forward_pass_cases() -> list:
    """Every group size on every place; on the accelerator also without streams (upstream's default there)."""
    cases = [
        pytest.param(*where.values, options, id=f"{where.id}-{label}", marks=where.marks)
        for where in PLACES
        for label, options in FORWARD_PASS_OPTIONS.items()
    ]
    cases += [
        pytest.param(
            ACCELERATOR,
            storage,
            {**FORWARD_PASS_OPTIONS[label], "use_stream": False},
            id=f"accel-{storage}-{label}-nostream",
            marks=on_accelerator,
        )
        for storage in ACCELERATOR_STORAGES
        for label in ("block1", "leaf")
    ]
    return cases


@pytest.mark.parametrize("device, storage, options", _forward_pass_cases())
def test_offloading_forward_pass(device, storage, options, tmp_path, strict_streams):
    """``test_offloading_forward_pass`` (precision half): every group size and offload type gives the
    full-load output, the forward wrappers are in place while the mode is applied and all gone after
    ``remove()``, which leaves the model computing the same on its own. On the accelerator with streams,
    the second call prefetches on a side stream (see :func:`assert_prefetched`); without, nothing streams."""
    model = seeded(BlockModel)
    handle = place(model, "model_group_offload", device, storage, tmp_path, **options)
    assert hook_count(model) > 0
    assert_bit_equal(forward(model, device=device), reference(BlockModel, device))
    assert_bit_equal(forward(model, device=device), reference(BlockModel, device), "second call")
    assert handle.report().onloads > 0
    assert_prefetched(strict_streams, storage, streamed=options.get("use_stream", True))
    handle.remove()
    assert hook_count(model) == 0
    assert_bit_equal(forward(model.to(device), device=device), reference(BlockModel, device), "after remove()")


def _peak(mode: str, device: str, **options) -> int:
    """Peak weight bytes on the device over two calls (prefetching starts once the first call has
    recorded the execution order)."""
    model = seeded(lambda: BlockModel(num_blocks=4))
    handle = memmode.apply(model, mode, device=device, storage=None if mode == "model_full_load" else "ram", **options)
    forward(model, device=device)
    forward(model, device=device)
    peak = handle.report().peak_device_bytes
    handle.remove()
    return peak


@pytest.mark.parametrize(
    "device, streams",
    [pytest.param("cpu", False, id="cpu"), pytest.param(ACCELERATOR, True, id="accel", marks=on_accelerator)],
)
def test_offloading_reduces_peak_device_memory(device, streams):
    """``test_offloading_forward_pass`` (memory half): ``leaf <= leaf+stream < block1 <= block1+stream
    < block3 < full load``, read from memmode's ledger (peak weight bytes on the device), which counts
    on a CPU too. A prefetched group is on the device early, so streams may only add to a peak; they
    exist on the accelerator only."""
    leaf = _peak("model_group_offload", device, use_stream=False, **LEAF)
    block1 = _peak("model_group_offload", device, use_stream=False, **BLOCK)
    block3 = _peak("model_group_offload", device, offload_type="block_level", num_blocks_per_group=3, use_stream=False)
    full = _peak("model_full_load", device)
    assert leaf < block1 < block3 < full
    if streams:
        leaf_stream = _peak("model_group_offload", device, use_stream=True, **LEAF)
        block1_stream = _peak("model_group_offload", device, use_stream=True, **BLOCK)
        assert leaf <= leaf_stream < block1 <= block1_stream < block3


@requires_cuda("torch.cuda.max_memory_allocated is the CUDA caching allocator's own counter")
def test_offloading_reduces_accelerator_memory():
    """``test_offloading_forward_pass`` with the accelerator's own counter, as upstream measures it."""

    def measured(mode: str, **options) -> int:
        model = seeded(lambda: BlockModel(features=256, num_blocks=4))
        handle = memmode.apply(
            model, mode, device="cuda", storage=None if mode == "model_full_load" else "ram", **options
        )
        forward(model, device="cuda")  # allocates cuBLAS' workspace, which then weighs the same in every peak
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        forward(model, device="cuda")
        peak = torch.cuda.max_memory_allocated()
        handle.remove()
        return peak

    leaf = measured("model_group_offload", use_stream=False, **LEAF)
    block1 = measured("model_group_offload", use_stream=False, **BLOCK)
    block3 = measured("model_group_offload", offload_type="block_level", num_blocks_per_group=3, use_stream=False)
    full = measured("model_full_load")
    assert leaf <= block1 < block3 < full


def test_error_raised_if_streams_used_and_no_accelerator_device(monkeypatch):
    """Streams need CUDA: with CUDA reported unavailable (as upstream patches it), the default device
    is the CPU and ``use_stream=True`` is refused before anything is changed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = seeded(BlockModel)
    before, weights = snapshot(model), state_of(model)
    with pytest.raises(InvalidOptionError, match="use_stream"):
        memmode.apply(model, "model_group_offload", use_stream=True, **LEAF)
    assert_untouched(model, before, weights)


@pytest.mark.parametrize("options", [pytest.param(BLOCK, id="block"), pytest.param(LEAF, id="leaf")])
def test_supports_group_offloading_false_moves_whole_or_is_refused_with_strict(options):
    """A model that says it cannot be group offloaded (``_supports_group_offloading = False``): diffusers
    refuses it; memmode moves it whole (one group, onloaded for its call) and says so, and with
    ``strict=True`` refuses with a ``MemmodeError`` before anything is changed."""
    model = seeded(BlockModel)
    model._supports_group_offloading = False
    before, weights = snapshot(model), state_of(model)
    with pytest.raises(MemmodeError, match="_supports_group_offloading"):
        memmode.apply(model, "model_group_offload", device="cpu", storage="poison", strict=True, **options)
    assert_untouched(model, before, weights)
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage="poison", **options)
    assert "moved whole" in handle.report().placement_notes["module"]
    assert_bit_equal(forward(model, 1), reference(BlockModel))
    assert handle.report().resident_device_bytes == 0, "offloaded after its call"
    handle.remove()


def _enable_diffusers_offloading(pipe: SinglePipeline, scheme: str) -> None:
    if scheme == "model_cpu_offload":
        pipe.enable_model_cpu_offload(device="cpu")
    elif scheme == "sequential_cpu_offload":
        pipe.enable_sequential_cpu_offload(device="cpu")
    else:
        pipe.model.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)


def _pipeline_output(pipe: SinglePipeline) -> torch.Tensor:
    with torch.no_grad():
        return pipe(model_inputs(pipe.model)["x"])


@pytest.mark.parametrize("scheme", ["model_cpu_offload", "sequential_cpu_offload", "diffusers_group_offload"])
def test_diffusers_offloading_enabled_on_a_memmode_placed_pipeline_is_refused(scheme):
    """``test_error_raised_if_{model,sequential}_offloading_applied_on_group_offloaded_module``: two
    offloading schemes never fight over one model. diffusers' ``enable_model_cpu_offload``,
    ``enable_sequential_cpu_offload`` (on the pipeline) and ``enable_group_offload`` (on the component)
    after memmode placed the pipeline are refused at that call with ``IncompatibleModeError``, before
    anything changes: memmode keeps placing it, exactly as before."""
    pipe = SinglePipeline(seeded(BlockModel))
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison", **BLOCK)
    expected = _pipeline_output(SinglePipeline(seeded(BlockModel)))
    assert_bit_equal(_pipeline_output(pipe), expected, "under memmode")
    wrappers = active_wrappers(pipe.model)
    with pytest.raises(IncompatibleModeError, match="memmode mode 'model_group_offload' is applied"):
        _enable_diffusers_offloading(pipe, scheme)
    assert handle.active and active_wrappers(pipe.model) == wrappers
    assert_bit_equal(_pipeline_output(pipe), expected, "under memmode, after the refusal")
    handle.remove()
    if scheme == "model_cpu_offload":  # diffusers' offloading works on the pipeline memmode gave back
        pipe.enable_model_cpu_offload(device="cpu")
        assert_bit_equal(_pipeline_output(pipe), expected, "under diffusers' model_cpu_offload")


@pytest.mark.parametrize("scheme", ["model_cpu_offload", "sequential_cpu_offload"])
def test_cpu_offloading_enabled_on_a_pipeline_whose_component_memmode_placed_does_not_stack(scheme):
    """memmode placed the component by itself, so the pipeline's ``enable_*_cpu_offload`` is not memmode's
    to refuse: accelerate's hooks land on top, memmode refuses the next call with
    ``IncompatibleModeError`` (docs/placements.md, "Hooks added after apply"), and ``remove()`` gives every
    weight back intact; diffusers' offloading then computes alone, exactly."""
    pipe = SinglePipeline(seeded(BlockModel))
    weights = state_of(pipe)
    handle = memmode.apply(pipe.model, "model_group_offload", device="cpu", storage="poison", **BLOCK)
    expected = _pipeline_output(SinglePipeline(seeded(BlockModel)))
    assert_bit_equal(_pipeline_output(pipe), expected, "under memmode")
    _enable_diffusers_offloading(pipe, scheme)
    with pytest.raises(IncompatibleModeError):
        _pipeline_output(pipe)
    handle.remove()
    assert not active_wrappers(pipe.model), "memmode still acts under diffusers' offloading"
    if scheme == "model_cpu_offload":  # accelerate's sequential offload cannot execute on a CPU device
        assert_bit_equal(_pipeline_output(pipe), expected, f"under diffusers' {scheme}")
        assert_same_tensors(state_of(pipe), weights)


@pytest.mark.parametrize("target", ["pipeline", "component"])
@pytest.mark.parametrize("scheme", ["model_cpu_offload", "sequential_cpu_offload", "diffusers_group_offload"])
def test_error_raised_if_group_offloading_applied_on_offloaded_module(scheme, target):
    """``test_error_raised_if_group_offloading_applied_on_{model,sequential}_offloaded_module``: a
    model whose weights another scheme already moves (accelerate's hooks, or diffusers' own group
    offloading) is refused, applied to the pipeline or to the component, and that scheme keeps working."""
    pipe = SinglePipeline(seeded(BlockModel))
    _enable_diffusers_offloading(pipe, scheme)
    obj = pipe if target == "pipeline" else pipe.model
    hook = type(getattr(pipe.model, "_hf_hook", None))
    before, weights = snapshot(obj), state_of(obj)
    with pytest.raises(IncompatibleModeError):
        memmode.apply(obj, "model_group_offload", device="cpu", storage="poison", **BLOCK)
    assert_untouched(obj, before, weights)
    assert type(getattr(pipe.model, "_hf_hook", None)) is hook
    if scheme != "sequential_cpu_offload":  # accelerate's sequential offload cannot execute on a CPU device
        assert_bit_equal(_pipeline_output(pipe), _pipeline_output(SinglePipeline(seeded(BlockModel))))


@pytest.mark.parametrize("num_blocks_per_group", [1, 2])
@pytest.mark.parametrize("device, storage", PLACES)
def test_block_level_stream_with_invocation_order_different_from_initialization_order(
    device, storage, num_blocks_per_group, tmp_path, strict_streams
):
    """Blocks created in one order and called in another (upstream: a device mismatch with streams
    before diffusers 0.34; it only checks that the call runs). Here three calls, the first of which
    records the prefetch order on the accelerator, equal full load at one and two blocks per group."""
    model = seeded(ReorderedBlockModel)
    place(
        model,
        "model_group_offload",
        device,
        storage,
        tmp_path,
        offload_type="block_level",
        num_blocks_per_group=num_blocks_per_group,
    )
    for call in range(3):
        assert_bit_equal(forward(model, device=device), reference(ReorderedBlockModel, device), f"call {call + 1}")
    assert_prefetched(strict_streams, storage)


def _track_outputs(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Record every module's output at every call (a torch forward hook on each module)."""
    outputs: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        record = outputs.setdefault(name, [])
        module.register_forward_hook(lambda m, args, out, record=record: record.append(out.detach().clone()))
    return outputs


@pytest.mark.parametrize("options", [pytest.param(BLOCK, id="block"), pytest.param(LEAF, id="leaf")])
@pytest.mark.parametrize("device, storage", PLACES)
def test_block_level_offloading_with_parameter_only_module_group(device, storage, options, tmp_path):
    """A module with parameters that belongs to no block (a ``LayerNorm`` between the last block and
    the head) is onloaded when it runs: every module's output, at every one of five calls, equals the
    un-offloaded model's, bit for bit (upstream: summed differences under 1e-5)."""
    ref_model = seeded(NormTailModel).to(device)
    model = seeded(NormTailModel)
    place(model, "model_group_offload", device, storage, tmp_path, **options)
    ref_outputs, outputs = _track_outputs(ref_model), _track_outputs(model)
    for _ in range(5):
        forward(ref_model, device=device)
        forward(model, device=device)
    called = {name: seen for name, seen in ref_outputs.items() if seen}  # a ModuleList is never called
    assert {name: len(seen) for name, seen in outputs.items() if seen} == {name: 5 for name in called}
    for name, seen in called.items():
        for call, (got, expected) in enumerate(zip(outputs[name], seen), start=1):
            assert_bit_equal(got, expected, f"module {name or '<root>'} at call {call}")


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"pin_groups": "invalid value"}, id="pin_groups-invalid"),
        pytest.param({"pin_groups": "first_last"}, id="pin_groups-unsupported"),
        pytest.param({"offload_type": "block"}, id="offload_type"),
        pytest.param({"num_blocks_per_group": 0}, id="num_blocks_per_group"),
    ],
)
def test_error_raised_if_options_are_invalid(options):
    """``test_error_raised_if_pin_groups_received_invalid_value``: an option memmode does not know, or
    a value it cannot honour, is refused at ``apply`` — before anything is changed, not at the first
    forward."""
    model = seeded(BlockModel)
    before, weights = snapshot(model), state_of(model)
    with pytest.raises(InvalidOptionError):
        memmode.apply(model, "model_group_offload", device="cpu", storage="poison", **options)
    assert_untouched(model, before, weights)


@pytest.mark.parametrize("use_quant_conv", [True, False], ids=["quant_conv", "no_quant_conv"])
@pytest.mark.parametrize("options", [pytest.param(BLOCK, id="block"), pytest.param(LEAF, id="leaf")])
@pytest.mark.parametrize("device, storage", PLACES)
def test_vae_like_model(device, storage, options, use_quant_conv, tmp_path):
    """``test_vae_like_model_without_streams``, ``test_standalone_conv_layers_with_both_offload_types``
    and ``test_multiple_invocations_with_vae_like_model``: an ``AutoencoderKL`` (standalone convs next
    to its encoder and decoder scopes) equals full load at both offload types, call after call. Also
    built without ``quant_conv`` / ``post_quant_conv`` (``None``, yet named in the model's
    ``_group_offload_block_modules``), as many released VAEs are."""
    factory = tiny_autoencoder if use_quant_conv else _autoencoder_without_quant_conv
    model = seeded(factory)
    place(model, "model_group_offload", device, storage, tmp_path, **options)
    for call in range(2):
        assert_bit_equal(forward(model, device=device), reference(factory, device), f"call {call + 1}")


def _autoencoder_without_quant_conv():
    return tiny_autoencoder(use_quant_conv=False)


@pytest.mark.parametrize(
    "factory", [StandaloneLayersModel, NestedContainerModel], ids=["standalone_layers", "nested_containers"]
)
@pytest.mark.parametrize("device, storage", PLACES)
def test_models_without_top_level_blocks(device, storage, factory, tmp_path):
    """``test_model_with_only_standalone_layers`` (no block list at all: everything is the rest group)
    and ``test_nested_container_parameters_offloading`` (the only block list two containers deep, next to
    a norm and projections of no block): equal to full load at block level, call after call."""
    model = seeded(factory)
    place(model, "model_group_offload", device, storage, tmp_path, **BLOCK)
    for call in range(2):
        assert_bit_equal(forward(model, device=device), reference(factory, device), f"call {call + 1}")


# -- the model tester mixin ------------------------------------------------------------------------


MODELS = [pytest.param(tiny_flux_transformer, id="flux"), pytest.param(tiny_wan_transformer, id="wan")]
MODEL_MODES = [
    pytest.param("model_group_offload", BLOCK, id="block"),
    pytest.param("model_group_offload", LEAF, id="leaf"),
    pytest.param("model_cpu_offload", {}, id="model_cpu_offload"),
    pytest.param("sequential_cpu_offload", {}, id="sequential"),
]


@pytest.mark.parametrize("mode, options", MODEL_MODES)
@pytest.mark.parametrize("factory", MODELS)
@pytest.mark.parametrize("device, storage", PLACES)
def test_model_offloading(device, storage, factory, mode, options, tmp_path):
    """``test_group_offloading`` (block and leaf level), ``test_cpu_offload`` and
    ``test_disk_offload_with_safetensors`` on real diffusers transformers (Flux: joint and single
    blocks; Wan: RoPE buffers and loose modulation tables): equal to full load, and between calls the
    offloaded parameters hold placeholders (the analogue of accelerate's ``meta`` device)."""
    model = seeded(factory)
    handle = place(model, mode, device, storage, tmp_path, **options)
    assert_bit_equal(forward(model, device=device), reference(factory, device))
    if storage in PLACEHOLDER_STORAGES and mode != "model_cpu_offload":  # it keeps its component resident
        assert not resting_weights(model, handle), "weights left on the device between calls"
    assert_bit_equal(forward(model, device=device), reference(factory, device), "second call")


@pytest.mark.parametrize("options", [pytest.param(BLOCK, id="block"), pytest.param(LEAF, id="leaf")])
@pytest.mark.parametrize("device, storage", places(cpu=["ram", "poison", "disk"]))
def test_group_offloading_with_layerwise_casting(device, storage, options, tmp_path):
    """diffusers' layerwise casting (fp16 storage, fp32 compute) enabled *after* the placement, as
    diffusers documents it: the model computes exactly what layerwise casting alone computes, call after
    call, and still does after ``remove()``, which leaves the casting hooks in place (docs/placements.md,
    "Hooks added after apply"). Upstream only checks that it runs."""
    model = seeded(tiny_flux_transformer)
    handle = place(model, "model_group_offload", device, storage, tmp_path, **options)
    model.enable_layerwise_casting(storage_dtype=torch.float16, compute_dtype=torch.float32)
    cast = seeded(tiny_flux_transformer)
    cast.enable_layerwise_casting(storage_dtype=torch.float16, compute_dtype=torch.float32)
    expected = forward(cast.to(device), device=device)
    for call in range(2):
        assert_bit_equal(forward(model, device=device), expected, f"call {call + 1}")
    handle.remove()
    assert_bit_equal(forward(model.to(device), device=device), expected, "after remove()")


@pytest.mark.parametrize("options", [pytest.param(BLOCK, id="block"), pytest.param(LEAF, id="leaf")])
@pytest.mark.parametrize("storage", sorted(FILE_STORAGES))
@pytest.mark.parametrize("device", ["cpu", pytest.param(ACCELERATOR, id="accel", marks=on_accelerator)])
def test_group_offloading_with_disk(device, storage, options, tmp_path):
    """``test_group_offloading_with_disk``: the offload folder holds exactly one safetensors file per
    offloaded group (at block level: the groups of the block layout, no extra and no missing file),
    the output equals full load, and ``remove()`` takes the files away."""
    folder = tmp_path / "offload"
    model = seeded(tiny_flux_transformer)
    handle = memmode.apply(
        model, "model_group_offload", device=device, storage=storage, offload_dir=str(folder), **options
    )
    files = sorted(folder.glob("*.safetensors"))
    stored = [g.key for g in handle.runtime.groups if g.policy is not Policy.RESIDENT]
    assert files and len(files) == len(stored), f"{len(files)} files for {len(stored)} offloaded groups"
    if options["offload_type"] == "block_level":
        expected = {spec.key for spec in block_groups("module", model, num_blocks_per_group=1)}
        assert set(stored) == expected
    assert handle.report().storage_bytes["disk_bytes"] == sum(f.stat().st_size for f in files)
    assert_bit_equal(forward(model, device=device), reference(tiny_flux_transformer, device))
    handle.remove()
    assert not list(folder.glob("*.safetensors"))


@pytest.mark.parametrize("storage", sorted(FILE_STORAGES))
def test_disk_offload_without_offload_dir_uses_a_private_folder(storage, tmp_path):
    """Where upstream's disk offload without an offload folder is an error, memmode's file storages
    write to a private temporary folder, and remove it with the placement."""
    model = seeded(tiny_wan_transformer)
    handle = memmode.apply(model, "sequential_cpu_offload", device="cpu", storage=storage)
    assert list(tmp_path.rglob("*.safetensors")), "no file written under the temporary folder"
    assert_bit_equal(forward(model), reference(tiny_wan_transformer))
    handle.remove()
    assert not list(tmp_path.rglob("*.safetensors"))


# -- the pipeline tester mixin ---------------------------------------------------------------------


PIPELINE_MODES = {
    "sequential": ("sequential_cpu_offload", {}),
    "model_cpu_offload": ("model_cpu_offload", {}),
    "group-leaf": ("model_group_offload", LEAF),
    "group-block": ("model_group_offload", BLOCK),
}


def _pipeline_cases() -> list:
    """Every mode on two families with the in-memory storages; the file storages on one family with the
    placements that write few files (test_file_storages crosses them with every placement and family)."""
    cases = []
    for family in ("flux", "wan22"):
        for label, (mode, options) in PIPELINE_MODES.items():
            cases += [
                pytest.param(
                    device,
                    storage,
                    family,
                    mode,
                    options,
                    id=f"{where}-{storage}-{family}-{label}",
                    marks=[on_accelerator] if where == "accel" else [],
                )
                for where, device, storages in (
                    ("cpu", "cpu", ("ram", "poison")),
                    ("accel", ACCELERATOR, ("ram", "pinned")),
                )
                for storage in storages
            ]
    for label in ("model_cpu_offload", "group-block"):
        mode, options = PIPELINE_MODES[label]
        cases += [
            pytest.param("cpu", storage, "flux", mode, options, id=f"cpu-{storage}-flux-{label}")
            for storage in sorted(FILE_STORAGES)
        ]
    return cases


def pipeline_reference(family: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Calls 1 and 2 of a fresh, un-offloaded pipeline on ``device``."""
    if device == "cpu":
        return full_load_outputs(family)
    key = ("pipeline", family, device)
    if key not in _REFERENCES:
        pipe = make_pipeline(family).to(device)
        _REFERENCES[key] = (run(pipe, family, 0), run(pipe, family, 1))
    return _REFERENCES[key]


@pytest.mark.parametrize("device, storage, family, mode, options", _pipeline_cases())
def test_pipeline_offload_forward_pass(device, storage, family, mode, options, tmp_path):
    """``test_sequential_cpu_offload_forward_pass``, ``test_model_cpu_offload_forward_pass`` and
    ``test_pipeline_level_group_offloading_inference`` / ``_sanity_checks``: the pipeline computes on the
    requested device (``pipe._execution_device``, through the ``_hf_hook`` every component carries), its
    output equals full load call after call, and between calls every component is offloaded (except,
    under ``model_cpu_offload``, the one called last, which stays until another one needs the device)."""
    pipe = make_pipeline(family)
    handle = place(pipe, mode, device, storage, tmp_path, **options)
    assert pipe._execution_device.type == device
    modules = module_components(pipe)
    assert all(getattr(m, "_hf_hook", None) is not None for m in modules.values())
    expected = pipeline_reference(family, device)
    for call in range(2):
        assert_bit_equal(run(pipe, family, call), expected[call], f"call {call + 1}")
    if storage in PLACEHOLDER_STORAGES:
        last = handle.report().call_sequence[-1]
        for name, module in modules.items():
            if name != last or mode != "model_cpu_offload":
                resting = resting_weights(module, handle)
                assert not resting, f"{name} keeps weights between calls: {resting[:5]}"


@pytest.mark.parametrize("mode", ["model_cpu_offload", "sequential_cpu_offload"])
@pytest.mark.parametrize(
    "device, storage",
    [
        pytest.param("cpu", "poison", id="cpu-poison"),
        pytest.param(ACCELERATOR, "pinned", id="accel-pinned", marks=on_accelerator),
    ],
)
def test_offload_forward_pass_twice(device, storage, mode, tmp_path):
    """``test_cpu_offload_forward_pass_twice`` / ``test_sequential_offload_forward_pass_twice``:
    applying the mode a second time replaces the first placement cleanly (one set of wrappers, the
    first handle inactive) and the outputs do not change."""
    family = "flux"
    pipe = make_pipeline(family)
    first = place(pipe, mode, device, storage, tmp_path)
    hooks = hook_count(pipe)
    out1 = run(pipe, family, 0)
    second = place(pipe, mode, device, storage, tmp_path)
    assert not first.active and second.active
    assert hook_count(pipe) == hooks
    out2 = run(pipe, family, 0)
    expected = pipeline_reference(family, device)[0]
    assert_bit_equal(out1, expected, "first placement")
    assert_bit_equal(out2, expected, "after applying again")


@pytest.mark.parametrize("options", [pytest.param(BLOCK, id="block"), pytest.param(LEAF, id="leaf")])
@pytest.mark.parametrize("device, storage", places(cpu=["ram", "poison"], accelerator=["pinned"]))
def test_component_level_group_offload_inside_a_pipeline(device, storage, options, tmp_path):
    """``test_group_offloading_inference``: group offloading applied component by component (text
    encoders and transformer) while the VAE is left alone on the device; the pipeline's output equals
    full load, and the component left out keeps its weights and has no wrapper (the ``exclude_modules``
    half of ``test_pipeline_level_group_offloading_sanity_checks``)."""
    family = "flux"
    pipe = make_pipeline(family)
    pipe.vae.to(device)
    names = [n for n in ("text_encoder", "text_encoder_2", "transformer") if isinstance(getattr(pipe, n), nn.Module)]
    handles = [place(getattr(pipe, n), "model_group_offload", device, storage, tmp_path / n, **options) for n in names]
    expected = pipeline_reference(family, device)
    for call in range(2):
        assert_bit_equal(run(pipe, family, call), expected[call], f"call {call + 1}")
    assert hook_count(pipe.vae) == 0 and not any(is_placeholder(p) for p in pipe.vae.parameters())
    for handle in handles:
        handle.remove()
    assert hook_count(pipe) == 0


@pytest.mark.parametrize("device, storage", places(cpu=["poison"], accelerator=["pinned"]))
def test_pipeline_level_group_offloading_sanity_checks(device, storage, tmp_path):
    """``unplaced`` (diffusers' ``exclude_modules``): the excluded component (the first
    module name in sorted order, as upstream picks it) gets no wrapper and keeps its real weights where
    the user put it; every other component rests offloaded between calls (its groups hold no device copy, and
    under a placeholder storage its weights are placeholders); the output equals full load."""
    family = "flux"
    pipe = make_pipeline(family)
    modules = module_components(pipe)
    excluded = sorted(modules)[0]
    modules[excluded].to(device)
    handle = place(pipe, "model_group_offload", device, storage, tmp_path, unplaced=[excluded], **LEAF)
    expected = pipeline_reference(family, device)
    for call in range(2):
        assert_bit_equal(run(pipe, family, call), expected[call], f"call {call + 1}")
    assert hook_count(modules[excluded]) == 0
    assert all(p.device.type == device and not is_placeholder(p) for p in modules[excluded].parameters())
    assert {g.component for g in handle.runtime.groups} == set(modules) - {excluded}
    assert not onloaded_groups(handle), "groups left on the device between calls"
    if storage in PLACEHOLDER_STORAGES:
        for name, module in modules.items():
            if name != excluded:
                assert not resting_weights(module, handle), f"{name} keeps weights between calls"
