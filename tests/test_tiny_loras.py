"""``tiny_loras`` adapters work with diffusers' LoRA API on plain pipelines (no memory mode involved).

What the LoRA-under-memory-mode tests rely on: every family in ``LORA_FAMILIES`` loads two
adapters, switches and weights them, fuses/unfuses, deletes and unloads them, with the expected
outputs, deterministically.
"""

from __future__ import annotations

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from helpers import TINY_PIPELINE_CALL, assert_reassociated, module_components
from tiny_loras import (
    DENOISERS,
    LORA_FAMILIES,
    TEXT_ENCODER_LORA_COMPONENTS,
    load_kwargs,
    load_lora,
    lora_components,
    make_lora,
)
from tiny_pipelines import FAMILIES, full_load_outputs, make_pipeline, run

VISIBLE = 1e-2  # a LoRA (or a change of the active adapters) moves the output by at least this much


def _text_encoder(family: str) -> bool:
    return bool(TEXT_ENCODER_LORA_COMPONENTS[family])


def _max_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _lora_layers(pipe, component: str, adapter_name: str) -> list[str]:
    """Names of ``component``'s modules that hold a LoRA ``adapter_name``."""
    return [
        name
        for name, module in getattr(pipe, component).named_modules()
        if isinstance(module, BaseTunerLayer) and adapter_name in module.lora_A
    ]


def _module_paths(state_dict: dict, prefix: str) -> set[str]:
    return {key[len(prefix) + 1 :].rsplit(".lora_", 1)[0] for key in state_dict if key.startswith(prefix + ".")}


# --------------------------------------------------------------------------- the state dicts


def test_all_families_are_covered():
    assert set(LORA_FAMILIES) == set(FAMILIES)


def test_state_dict_format(family):
    rank = 3
    state_dict = make_lora(family, seed=0, rank=rank, text_encoder=_text_encoder(family))
    prefixes = {"transformer", *TEXT_ENCODER_LORA_COMPONENTS[family]}
    assert {key.split(".", 1)[0] for key in state_dict} == prefixes
    for key, tensor in state_dict.items():
        assert key.endswith((".lora_A.weight", ".lora_B.weight")), key
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.ndim == 2
        assert torch.isfinite(tensor).all() and tensor.abs().max() > 0, key
        if key.endswith(".lora_A.weight"):
            partner = state_dict[key.replace(".lora_A.", ".lora_B.")]
            assert tensor.shape[0] == rank and partner.shape[1] == rank, key
    # Attention projections and feed-forward layers of the denoiser, in every block.
    paths = _module_paths(state_dict, "transformer")
    assert any(".to_q" in path for path in paths) and any(".to_out.0" in path for path in paths)
    assert any(path.endswith(".net.2") for path in paths)
    assert {path.split(".")[1] for path in paths if path[0].isalpha() and path.split(".")[1].isdigit()} == {"0", "1"}


def test_state_dicts_are_deterministic_and_seeded(family):
    rng = torch.get_rng_state()
    first = make_lora(family, seed=5)
    assert torch.equal(torch.get_rng_state(), rng), "make_lora touched the global RNG"
    second = make_lora(family, seed=5)
    other = make_lora(family, seed=6)
    assert first.keys() == second.keys() == other.keys()
    for key in first:
        assert torch.equal(first[key], second[key]) and first[key] is not second[key]
        assert not torch.equal(first[key], other[key])
    half = make_lora(family, seed=5, dtype=torch.bfloat16)
    assert all(tensor.dtype == torch.bfloat16 for tensor in half.values())
    if _text_encoder(family):  # the denoiser part does not depend on text_encoder=True
        with_te = make_lora(family, seed=5, text_encoder=True)
        assert all(torch.equal(with_te[key], tensor) for key, tensor in first.items())


def test_text_encoder_lora_only_where_the_loader_supports_it(family):
    if _text_encoder(family):
        make_lora(family, text_encoder=True)
    else:
        with pytest.raises(ValueError, match="text-encoder"):
            make_lora(family, text_encoder=True)


def test_wan22_experts_get_different_loras_with_the_same_keys():
    high, low = (make_lora("wan22", seed=1, denoiser=denoiser) for denoiser in DENOISERS["wan22"])
    assert high.keys() == low.keys()
    assert all(key.startswith("transformer.") for key in low)  # the Wan loader strips "transformer."
    assert not any(torch.equal(high[key], low[key]) for key in high)
    assert load_kwargs("wan22", "transformer_2") == {"load_into_transformer_2": True}
    assert load_kwargs("wan22") == {} and load_kwargs("flux") == {}
    with pytest.raises(ValueError):
        make_lora("flux", denoiser="transformer_2")


# --------------------------------------------------------------------------- loading


def test_every_key_lands_and_every_component_changes_the_output(family):
    """No key is dropped silently, and each component's LoRA on its own changes the output."""
    base = full_load_outputs(family)[0]  # a fresh pipeline's first call
    for component in lora_components(family, text_encoder=_text_encoder(family)):
        pipe = make_pipeline(family)
        if component in DENOISERS[family]:
            state_dict = make_lora(family, seed=1, denoiser=component)
            pipe.load_lora_weights(state_dict, adapter_name="a", **load_kwargs(family, component))
            expected = _module_paths(state_dict, "transformer")
        else:
            state_dict = make_lora(family, seed=1, text_encoder=True)
            state_dict = {key: value for key, value in state_dict.items() if key.startswith(component + ".")}
            pipe.load_lora_weights(state_dict, adapter_name="a")
            expected = _module_paths(state_dict, component)
            if not hasattr(pipe.text_encoder, "text_model"):  # transformers 5's flattened CLIPTextModel
                expected = {path.removeprefix("text_model.") for path in expected}
        assert set(_lora_layers(pipe, component, "a")) == expected, component
        assert {name for name, adapters in pipe.get_list_adapters().items() if adapters} == {component}
        output = run(pipe, family)
        assert torch.isfinite(output).all()
        assert _max_change(output, base) > VISIBLE, component


def test_low_precision_pipeline_takes_a_low_precision_lora(family):
    dtype = torch.bfloat16
    pipe = make_pipeline(family, dtype=dtype)
    base = run(pipe, family)
    load_lora(pipe, family, "a", seed=1, dtype=dtype, text_encoder=_text_encoder(family))
    output = run(pipe, family)
    assert torch.isfinite(output).all() and _max_change(output, base) > VISIBLE


# --------------------------------------------------------------------------- operations


def _lora_ops(family: str) -> dict[str, torch.Tensor]:
    """One pipeline through the LoRA operations; the output after each, with structural checks on the way."""
    text_encoder = _text_encoder(family)
    components = lora_components(family, text_encoder)
    pipe = make_pipeline(family)
    out = {"base": run(pipe, family)}

    load_lora(pipe, family, "a", seed=1, text_encoder=text_encoder)
    out["a"] = run(pipe, family)
    load_lora(pipe, family, "b", seed=2, text_encoder=text_encoder)
    out["b_loaded"] = run(pipe, family)  # loading an adapter makes it the only active one
    assert pipe.get_list_adapters() == {component: ["a", "b"] for component in components}

    pipe.set_adapters(["a", "b"], adapter_weights=[1.0, 0.5])
    out["a+b/2"] = run(pipe, family)
    pipe.set_adapters("b")
    out["b"] = run(pipe, family)

    pipe.set_adapters(["a", "b"], adapter_weights=[1.0, 0.5])
    pipe.fuse_lora(components=components)
    assert pipe.fused_loras == {"a", "b"}
    out["fused"] = run(pipe, family)
    pipe.unfuse_lora(components=components)
    assert pipe.fused_loras == set()
    out["unfused"] = run(pipe, family)

    pipe.delete_adapters("a")
    assert pipe.get_list_adapters() == {component: ["b"] for component in components}
    for component in components:
        assert not _lora_layers(pipe, component, "a") and _lora_layers(pipe, component, "b")
    pipe.set_adapters("b")
    out["deleted_a"] = run(pipe, family)

    pipe.unload_lora_weights()
    assert not any(pipe.get_list_adapters().values())
    for name, component in module_components(pipe).items():
        assert not any(isinstance(module, BaseTunerLayer) for module in component.modules()), name
    out["unloaded"] = run(pipe, family)
    return out


_OPS_CACHE: dict[str, dict[str, torch.Tensor]] = {}


def _lora_ops_once(family: str) -> dict[str, torch.Tensor]:
    """``_lora_ops(family)``, run once per session (the determinism test compares a second run with it)."""
    if family not in _OPS_CACHE:
        _OPS_CACHE[family] = _lora_ops(family)
    return _OPS_CACHE[family]


def test_lora_operations(family):
    out = _lora_ops_once(family)
    for name, output in out.items():
        assert torch.isfinite(output).all(), name
    # Loading, combining and switching adapters change the output visibly.
    assert _max_change(out["a"], out["base"]) > VISIBLE
    assert _max_change(out["b_loaded"], out["a"]) > VISIBLE
    assert _max_change(out["a+b/2"], out["a"]) > VISIBLE
    assert _max_change(out["a+b/2"], out["base"]) > VISIBLE
    assert _max_change(out["b"], out["a+b/2"]) > VISIBLE
    # Each pair is the same model summed otherwise (adapters added in another order, a delta fused into the weight
    # and taken out again: one rounding of each weight more), so within float32 reassociation of each other.
    assert_reassociated(out["b"], out["b_loaded"], **TINY_PIPELINE_CALL)
    # Fusing the active adapters (with their weights) gives the unfused output; unfusing restores it.
    assert_reassociated(out["fused"], out["a+b/2"], **TINY_PIPELINE_CALL)
    assert_reassociated(out["unfused"], out["a+b/2"], **TINY_PIPELINE_CALL)
    # Deleting "a" leaves "b" as it was; unloading restores the original pipeline.
    assert_reassociated(out["deleted_a"], out["b"], **TINY_PIPELINE_CALL)
    assert_reassociated(out["unloaded"], out["base"], **TINY_PIPELINE_CALL)


def test_lora_operations_are_deterministic(family):
    first, second = _lora_ops_once(family), _lora_ops(family)
    for name in first:
        assert torch.equal(first[name], second[name]), name
