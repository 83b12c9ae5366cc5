"""Checks of the properties the memory-mode tests rely on in ``tiny_pipelines``: builds deterministic, in eval
mode and on the CPU, leaving the global RNG alone; outputs finite, not constant, depending on both seeds; every
component of a family influencing its output. The five families memmode was written for in detail (low-precision
builds, block lists, Wan 2.2's two experts); every family the pipeline sweep runs, for what the sweep relies on."""

import pytest
import torch

from helpers import in_slice, module_components
from tiny_components import lookup
from tiny_pipelines import ALL_FAMILIES, full_load_outputs, make_pipeline, run


def test_build_is_deterministic_eval_and_on_cpu(family):
    first, second = make_pipeline(family, seed=0), make_pipeline(family, seed=0)
    assert module_components(first).keys() == module_components(second).keys()
    for name, module in module_components(first).items():
        assert not module.training, name
        state, other = module.state_dict(), module_components(second)[name].state_dict()
        assert state.keys() == other.keys()
        for key, tensor in state.items():
            assert tensor.device.type == "cpu", (name, key)
            assert torch.equal(tensor, other[key]), (name, key)


def test_build_does_not_touch_the_global_rng(family):
    state = torch.get_rng_state()
    make_pipeline(family)
    assert torch.equal(torch.get_rng_state(), state)


def test_runs_are_deterministic_call_by_call(family):
    first, second = make_pipeline(family, seed=0), make_pipeline(family, seed=0)
    first_outputs = [run(first, family, seed=0), run(first, family, seed=0)]
    second_outputs = [run(second, family, seed=0), run(second, family, seed=0)]
    for a, b in zip(first_outputs, second_outputs):
        assert torch.equal(a, b)


def test_output_is_a_finite_nonconstant_float_image(family):
    output = full_load_outputs(family)[0]  # a fresh pipeline's first call
    assert output.dtype == torch.float32 and output.device.type == "cpu"
    assert output.shape[-3] == 3  # RGB, channels-first ("pt" output): (B, C, H, W) or (B, F, C, H, W)
    assert torch.isfinite(output).all()
    assert output.std() > 1e-2


def test_output_depends_on_the_seeds(family):
    reference, other_call_seed = full_load_outputs(family)  # a fresh pipeline (seed 0) called with seeds 0 and 1
    assert not torch.equal(reference, run(make_pipeline(family, seed=1), family, seed=0))
    assert not torch.equal(reference, other_call_seed)


def test_every_module_influences_the_output(family):
    """Perturbing any one component's weights changes the output: none is idle or bypassed."""
    reference = full_load_outputs(family)[0]
    pipe = make_pipeline(family)
    for name in module_components(pipe):  # one component perturbed at a time, put back before the next
        generator = torch.Generator().manual_seed(1)
        parameters = list(getattr(pipe, name).parameters())
        originals = [parameter.detach().clone() for parameter in parameters]
        with torch.no_grad():
            for parameter in parameters:
                parameter.mul_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
            change = (run(pipe, family) - reference).abs().max()
            for parameter, original in zip(parameters, originals):
                parameter.copy_(original)
        assert change > 1e-4, name


def test_transformers_have_at_least_two_blocks_per_block_list(family):
    pipe = make_pipeline(family)
    transformers = [m for name, m in module_components(pipe).items() if name.startswith("transformer")]
    assert transformers
    for transformer in transformers:
        block_lists = [child for child in transformer.children() if isinstance(child, torch.nn.ModuleList)]
        assert block_lists and all(len(blocks) >= 2 for blocks in block_lists)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_build_runs(family, dtype):
    pipe = make_pipeline(family, dtype=dtype)
    for name, module in module_components(pipe).items():
        assert any(p.dtype == dtype for p in module.parameters()), name
    assert torch.isfinite(run(pipe, family)).all()


def test_wan22_runs_both_experts():
    pipe = make_pipeline("wan22")
    assert pipe.config.boundary_ratio is not None
    assert isinstance(pipe.transformer_2, type(pipe.transformer))
    assert not torch.equal(next(pipe.transformer.parameters()), next(pipe.transformer_2.parameters())), (
        "the two experts should hold different weights"
    )
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    run(pipe, "wan22")
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0, calls


# -- every family: what the pipeline sweep relies on---------------------------------------------------------


@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
def test_build_is_deterministic_eval_finite_nonconstant_and_seeded(family):
    spec = ALL_FAMILIES[family]
    reference = full_load_outputs(family)
    rng = torch.get_rng_state()
    pipe = spec.make(0)
    assert torch.equal(torch.get_rng_state(), rng), "a build must leave the global RNG alone"
    assert all(not m.training for m in module_components(pipe).values()), "components must be in eval mode"
    output = spec.run(pipe, 0)
    assert output.dtype == torch.float32 and output.device.type == "cpu"
    assert torch.isfinite(output).all()
    assert output.std() > 1e-2, "a near-constant output would hide differences"
    assert torch.equal(output, reference[0]), "two builds with the same seed must give the same output"
    assert not torch.equal(reference[1], reference[0]), "the call seed must matter"


@pytest.mark.parametrize("family", [f for i, f in enumerate(sorted(ALL_FAMILIES)) if in_slice(i, 0)])
def test_every_component_influences_the_output(family):
    """Perturbing any one component's weights changes the output: a component that is idle or bypassed would
    let a placement that mishandles it pass the sweep."""
    spec = ALL_FAMILIES[family]
    pipe = spec.make(0)
    generator = torch.Generator().manual_seed(1)
    for name, module in module_components(pipe).items():
        parameters = list(module.parameters())
        originals = [parameter.detach().clone() for parameter in parameters]
        with torch.no_grad():
            for parameter in parameters:
                parameter.mul_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
            change = (spec.run(pipe, 0) - full_load_outputs(family)[0]).abs().max()
            for parameter, original in zip(parameters, originals):
                parameter.copy_(original)
        assert change > 1e-5, f"{name} has no influence on the output"


def test_a_name_the_installed_library_lacks_skips_what_needs_it_and_says_so():
    """``lookup``: how a family built from a class newer than pyproject's lower bound runs on the lowest lane."""
    from diffusers import FluxPipeline

    assert lookup("diffusers", "FluxPipeline") is FluxPipeline
    missing = lookup("diffusers.pipelines", "NoSuchPipeline")
    reason = r"needs diffusers\.pipelines\.NoSuchPipeline, which diffusers \S+ lacks"
    with pytest.raises(pytest.skip.Exception, match=reason):
        missing(transformer=None)
    with pytest.raises(pytest.skip.Exception, match="NoSuchPipeline"):
        missing.from_pretrained("folder")
    with pytest.raises(pytest.skip.Exception, match=r"needs diffusers\.no_such_module\.Thing"):
        lookup("diffusers.no_such_module", "Thing")()
