"""``prepare(target, mode) -> Prepared``: one plan, computed once, that ``apply``, the planner, ``load`` and
``auto`` reuse instead of computing it again.

The expensive steps are counted with the profiler, which counts calls of a function however it is
referenced: resolving the mode, routing the options, laying the target out, claiming the groups,
planning each quantized component and sizing the groups each happen once per ``apply``.
"""

from __future__ import annotations

import cProfile
import dataclasses
import pstats
from collections import Counter

import pytest
import torch

import memmode_core as memmode
from memmode_core.builtin.placements import GroupOffloadOptions
from memmode_core.contracts.options import Option, Options, options_type, resolve_options
from memmode_core.engine.groups import claim_groups
from tiny_pipelines import FAMILIES, make_pipeline, run

#: function name -> what the step is; each must run once per apply (plans: once per quantized component)
STEPS = {
    "resolve": "resolving the mode's names",
    "resolve_options": "building the typed options",
    "lay_out": "laying the target out",
    "claim_groups": "claiming the groups' tensors",
    "group_bytes": "sizing the groups",
    "decide_layers": "deciding which layers of a component are packed",
}


def counted(function, *args, **kwargs):
    """``function(*args, **kwargs)`` and how many times each memmode function in ``STEPS`` ran meanwhile."""
    profiler = cProfile.Profile()
    result = profiler.runcall(function, *args, **kwargs)
    calls: Counter[str] = Counter()
    for (path, _, name), (_, total, *_rest) in pstats.Stats(profiler).stats.items():
        if name in STEPS and "memmode_core" in path:
            calls[name] += total
    return result, calls


MODES = [
    ("model_cpu_offload", {}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("model_group_offload_and_qfloat8", {}),
    ("sequential_cpu_offload_and_qfloat4", {}),
]


@pytest.mark.parametrize("mode, options", MODES, ids=[m for m, _ in MODES])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_apply_does_each_expensive_step_once(family, mode, options):
    pipe = make_pipeline(family)
    handle, calls = counted(memmode.apply, pipe, mode, device="cpu", **options)
    quantized = len(handle.quantized)
    expected = {name: 1 for name in STEPS if name != "decide_layers"}
    expected["decide_layers"] = quantized
    assert quantized == (2 if family == "wan22" else 1) if "_and_" in mode else quantized == 0
    assert {name: calls[name] for name in STEPS} == expected
    handle.remove()


@pytest.mark.parametrize("mode", ["model_group_offload_and_qfloat8", "sequential_cpu_offload_and_qfloat4"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_groups_claimed_before_quantizing_bind_to_what_claiming_now_finds(family, mode):
    """The groups are claimed once, before quantizing; the runtime binds them to the quantized model. What it
    binds must be exactly what claiming the quantized model would give: names, order, sizes, readable."""
    pipe = make_pipeline(family)
    prepared = memmode.prepare(pipe, mode, device="cpu")
    handle = memmode.apply(prepared)
    again = claim_groups(prepared.internal.target.components, prepared.internal.layout.specs)

    def shape(groups):
        return [
            (g.key, g.policy, [(s.name, s.owner, s.attr, s.is_buffer) for s in g.slots], g.nbytes, g.readable)
            for g in groups
        ]

    assert shape(handle.runtime.groups) == shape(again)
    assert {g.key: g.nbytes for g in again if g.key in prepared.stored_sizes} == prepared.stored_sizes
    handle.remove()


def test_executing_a_prepared_plan_computes_nothing_again():
    pipe = make_pipeline("wan22")
    prepared, calls = counted(memmode.prepare, pipe, "model_group_offload_and_qfloat8", device="cpu")
    assert all(calls[name] for name in STEPS)
    handle, calls = counted(memmode.apply, prepared)
    assert not any(calls[name] for name in STEPS), dict(calls)
    assert handle.prepared is prepared and handle.mode == "model_group_offload_and_qfloat8"
    handle.remove()


def test_prepare_touches_nothing_and_apply_of_it_equals_apply():
    reference = make_pipeline("flux")
    expected = memmode.apply(reference, "model_group_offload", device="cpu")
    want = [run(reference, "flux", 0), run(reference, "flux", 1)]
    expected.remove()
    pipe = make_pipeline("flux")
    state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    prepared = memmode.prepare(pipe, "model_group_offload", device="cpu")
    assert not hasattr(pipe, "_memmode_handle") and "forward" not in vars(pipe.transformer)
    torch.testing.assert_close(pipe.transformer.state_dict(), state, rtol=0, atol=0)
    handle = memmode.apply(prepared)
    got = [run(pipe, "flux", 0), run(pipe, "flux", 1)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    handle.remove()


def test_a_plan_whose_layers_were_packed_since_is_refused_before_anything_changes():
    pipe = make_pipeline("wan22")
    prepared = memmode.prepare(pipe, "model_cpu_offload_and_qfloat8", device="cpu")
    handle = memmode.apply(prepared)
    reference = [run(pipe, "wan22", 0)]
    with pytest.raises(memmode.IncompatibleModeError, match="prepare it again"):
        memmode.apply(prepared)
    assert handle.active and torch.equal(run(pipe, "wan22", 0), reference[0])
    again = memmode.apply(pipe, "model_group_offload_and_qfloat8", device="cpu")  # prepared afresh: a no-op quantize
    assert not handle.active and again.quantized["transformer"].no_op
    again.remove()


def test_a_prepared_plan_says_what_it_will_do():
    pipe = make_pipeline("wan22")
    prepared = memmode.prepare(pipe, "model_group_offload_and_qfloat8", device="cpu", offload_type="leaf_level")
    text = prepared.describe()
    assert "model_group_offload_and_qfloat8 for WanPipeline on cpu" in text
    assert "offload_type='leaf_level'" in text and "storage ram" in text
    assert "transformer: 20 layers to pack" in text and "transformer_2: 20 layers to pack" in text
    assert "text_encoder:" in text and "streamed" in text
    assert repr(prepared).startswith("<memmode.Prepared model_group_offload_and_qfloat8 storage=ram device=cpu")
    assert set(prepared.stored_sizes) == {g.key for g in prepared.groups}


def test_auto_resolves_to_a_prepared_candidate_and_executes_it_as_prepared():
    pipe = make_pipeline("wan22")
    prepared = memmode.prepare(pipe, "auto", device="cpu", vram_budget="130KB")
    assert prepared.mode == "model_group_offload" and prepared.requested_mode == "auto"
    assert prepared.choice.chosen and prepared.choice.prepared.internal is prepared.internal  # not prepared again
    assert "chosen by auto" in prepared.describe()
    handle, calls = counted(memmode.apply, prepared)
    assert not any(calls[name] for name in STEPS)
    assert handle.requested_mode == "auto" and handle.choice is prepared.choice
    assert handle.report().peak_device_bytes <= 130_000
    handle.remove()


def test_auto_refuses_what_only_a_quantizer_takes_when_it_has_none():
    with pytest.raises(memmode.InvalidOptionError, match="has no quantizer"):
        memmode.prepare(make_pipeline("flux"), "auto", device="cpu", components=["transformer"])


def test_auto_is_a_resolver_not_a_placement():
    from memmode_core.discovery.plugins import current

    auto = current().get("placement", "auto").obj
    assert isinstance(auto, memmode.Resolver) and not isinstance(auto, memmode.Placement)
    assert not hasattr(auto, "layout")


def test_the_planner_prices_prepared_plans():
    pipe = make_pipeline("ltx")
    entries = memmode.plan(pipe, device="cpu", quantizer="qfloat8")
    assert entries and all(isinstance(e.prepared, memmode.Prepared) for e in entries)
    assert all(e.prepared.mode == e.mode and e.prepared.storage == e.storage for e in entries if e.storage)
    assert "prepared" not in entries[0].as_dict()
    selections = {id(e.prepared.internal.selections["transformer"]) for e in entries}
    assert len(selections) == 1, "one layer selection, shared by every candidate"


# -- typed options ------------------------------------------------------------------------------------------


def test_options_are_a_frozen_dataclass_built_once():
    prepared = memmode.prepare(make_pipeline("flux"), "model_group_offload", device="cpu", num_blocks_per_group=2)
    options = prepared.options["placement"]
    assert isinstance(options, GroupOffloadOptions) and dataclasses.is_dataclass(options)
    assert options.num_blocks_per_group == 2 and options["num_blocks_per_group"] == 2
    assert dict(options) == {
        "offload_type": "block_level",
        "num_blocks_per_group": 2,
        "block_modules": None,
        "use_stream": None,
        "vram_budget": None,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_blocks_per_group = 3


def test_a_tuple_of_options_becomes_a_dataclass():
    declared = (Option("zram_level", 1, "zlib level", int), Option("zram_path", None, "where"))
    cls = options_type(declared, "storage zram")
    assert issubclass(cls, Options) and options_type(declared, "storage zram") is cls
    (built,) = resolve_options([("storage zram", declared)], {"zram_level": "3"})
    assert isinstance(built, cls) and built.zram_level == 3 and built["zram_path"] is None
    with pytest.raises(memmode.InvalidOptionError, match="unexpected option level"):
        resolve_options([("storage zram", declared)], {"level": 3})


def test_apply_prepare_and_load_take_the_request_arguments_alike():
    """Each public entry lists the shared keywords once, in its signature, and builds its request from them by
    name (``Request.from_call``): the names, kinds and defaults must be those of ``REQUEST_ARGUMENTS``."""
    import inspect

    from memmode_core.planning.request import REQUEST_ARGUMENTS

    for entry in (memmode.apply, memmode.prepare, memmode.load):
        parameters = inspect.signature(entry).parameters
        for name, default in REQUEST_ARGUMENTS.items():
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, (entry.__name__, name)
            assert parameters[name].default == default, (entry.__name__, name)
        assert "options" in parameters and parameters["options"].kind is inspect.Parameter.VAR_KEYWORD


def test_a_prepared_plan_is_sealed_and_executing_it_writes_nothing_into_it():
    """Nothing writes into a plan after prepare: not a user, not apply, not the packing stage (work done ahead of
    executing a plan, like load's packing while streaming, is a value handed to execute)."""
    import dataclasses

    pipe = make_pipeline("wan22")
    prepared = memmode.prepare(pipe, "model_group_offload_and_qfloat8", device="cpu", storage="mmap")
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.requested_mode = "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.internal.selections = {}
    claimed = [(g.key, g.policy, [id(slot.tensor) for slot in g.slots]) for g in prepared.internal.groups]
    before = dict(vars(prepared)), dict(vars(prepared.internal))
    handle = memmode.apply(prepared)
    assert (dict(vars(prepared)), dict(vars(prepared.internal))) == before
    # the engine binds groups of its own: the plan's claimed groups are as prepare left them
    assert not {id(g) for g in handle.runtime.groups} & {id(g) for g in prepared.internal.groups}
    assert [(g.key, g.policy, [id(slot.tensor) for slot in g.slots]) for g in prepared.internal.groups] == claimed
    handle.remove()


def test_a_prepared_plan_reads_as_plain_descriptions():
    """What a user reads of a plan is plain data: group descriptions, what quantizing will do, sizes, names and
    options; the engine objects it carries to apply are private."""
    pipe = make_pipeline("wan22")
    prepared = memmode.prepare(pipe, "model_group_offload_and_qfloat8", device="cpu", unplaced=["vae"])
    assert all(isinstance(g, memmode.PreparedGroup) for g in prepared.groups)
    assert {g.component for g in prepared.groups} == set(prepared.components)
    assert prepared.unplaced == ("vae",) and "vae" not in prepared.components
    assert sum(g.nbytes for g in prepared.groups if g.stored) == sum(prepared.stored_sizes.values())
    outline = prepared.quantization["transformer"]
    assert isinstance(outline, memmode.QuantizationOutline) and len(outline.to_pack) == 20
    assert outline.bytes_after < outline.bytes_before
    assert prepared.placement == "model_group_offload" and prepared.quantizer == "qfloat8"
    assert prepared.storage == "ram" and prepared.options["storage"] is not None
    public = {name for name in vars(prepared) if not name.startswith("_")}
    assert public <= {"internal", "requested_mode", "choice", "groups", "quantization"}, public
    # what the engine works from is in one object whose module says it is internal, not exported
    assert type(prepared.internal).__module__ == "memmode_core.planning.internal_plan"
    assert type(prepared.internal).__name__ not in memmode.__all__
    handle = memmode.apply(prepared)
    assert handle.report().quantization["transformer"]["packed_layers"] == len(outline.to_pack)
    handle.remove()
