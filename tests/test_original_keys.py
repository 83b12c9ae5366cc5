"""``diffusers_names``: a single file's original names traced through diffusers' converter to rows of its tensors."""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

from memmode_core.contracts.errors import CheckpointError
from memmode_core.loading.original_keys import Renamed, Rows, _LazyRows, diffusers_names
from original_checkpoints import ARCHITECTURES, FLUX, PREFIX, WAN, Architecture, convert_with_diffusers

IDS = [arch.name for arch in ARCHITECTURES]


@pytest.fixture(scope="module", params=ARCHITECTURES, ids=IDS)
def made(request):
    arch: Architecture = request.param
    model, values, original = arch.checkpoints()
    return arch, model, values, original


def _unprefixed(state: dict) -> dict:
    return {key.removeprefix(PREFIX): value for key, value in state.items()}


def test_fixture_is_what_diffusers_converts_back(made):
    """The fixture's original checkpoint is one diffusers' own converter turns into the model's state dict."""
    arch, model, values, original = made
    converted = _unprefixed(convert_with_diffusers(arch, original))
    assert set(converted) == set(values)
    for key, value in values.items():
        assert torch.equal(converted[key], value), key
    if arch.full_size:  # thin values: the full shapes are checked on meta
        shapes = {
            key: tuple(t.shape)
            for key, t in _unprefixed(convert_with_diffusers(arch, arch.meta_original(model))).items()
        }
        assert shapes == {key: tuple(t.shape) for key, t in model.state_dict().items()}


def test_rows_rebuild_what_the_converter_makes(made):
    """Each model tensor, cut out of the file's tensors by its rows, is the converter's output bit for bit."""
    arch, model, values, original = made
    renaming = diffusers_names(arch.model_class, model.config, arch.original_shapes(model), list(model.state_dict()))
    reference = _unprefixed(convert_with_diffusers(arch, original))
    assert list(renaming) == list(model.state_dict())
    assert (renaming.missing, renaming.unexpected) == ((), ())
    assert renaming.unused == tuple(arch.extra)
    assert renaming.prefix == PREFIX
    for key, renamed in renaming.items():
        assert renamed.shape == tuple(model.state_dict()[key].shape), key
        rebuilt = torch.cat([original[piece.key][piece.start : piece.stop] for piece in renamed.pieces])
        assert torch.equal(rebuilt, reference[key]), key


def test_which_converter_is_traced():
    names = {}
    for arch in ARCHITECTURES:
        model = arch.build()
        renaming = diffusers_names(
            arch.model_class, model.config, arch.original_shapes(model), list(model.state_dict())
        )
        names[arch.name] = renaming.converter and renaming.converter.rsplit(".", 1)[1]
    assert names == {
        "wan": "convert_wan_transformer_to_diffusers",
        "flux": "convert_flux_transformer_checkpoint_to_diffusers",
        "qwen-image": None,  # its original names are diffusers'
        "hunyuan-video": "convert_hunyuan_video_transformer_to_diffusers",
        "ltx-video": "convert_ltx_transformer_checkpoint_to_diffusers",
    }


def test_flux_splits_and_swaps_are_rows():
    model = FLUX.build()
    renaming = diffusers_names(FLUX.model_class, model.config, FLUX.original_shapes(model), list(model.state_dict()))
    qkv = f"{PREFIX}double_blocks.0.img_attn.qkv.weight"
    assert renaming["transformer_blocks.0.attn.to_k.weight"].pieces == (Rows(qkv, 3072, 6144),)
    linear1 = f"{PREFIX}single_blocks.0.linear1.bias"
    assert renaming["single_transformer_blocks.0.proj_mlp.bias"].pieces == (Rows(linear1, 9216, 21504),)
    final = f"{PREFIX}final_layer.adaLN_modulation.1.weight"
    assert renaming["norm_out.linear.weight"] == Renamed((6144, 3072), (Rows(final, 3072, 6144), Rows(final, 0, 3072)))
    assert renaming["x_embedder.weight"].pieces == (Rows(f"{PREFIX}img_in.weight", 0, 3072),)


@pytest.mark.parametrize("prefix", ["", "diffusion_model."])
def test_original_names_under_other_prefixes(prefix):
    """GGUF files often have no prefix; a file with ``diffusion_model.`` is traced without it."""
    for arch in (WAN, FLUX):
        model = arch.build()
        shapes = {prefix + key.removeprefix(PREFIX): shape for key, shape in arch.original_shapes(model).items()}
        renaming = diffusers_names(arch.model_class, model.config, shapes, list(model.state_dict()))
        assert set(renaming) == set(model.state_dict()) and not renaming.missing
        assert renaming.prefix == prefix
        assert all(piece.key.startswith(prefix) for r in renaming.values() for piece in r.pieces)


@pytest.mark.parametrize("prefix", ["", PREFIX, "diffusion_model."])
def test_the_model_own_names_are_taken_as_they_are(monkeypatch, prefix):
    def refuse(**_):
        raise AssertionError("the converter was called")

    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", {"checkpoint_mapping_fn": refuse})
    model = WAN.build()
    shapes = {prefix + key: tuple(t.shape) for key, t in model.state_dict().items()}
    shapes[prefix + "scaled_fp8"] = ()
    renaming = diffusers_names(WAN.model_class, model.config, shapes, list(model.state_dict()))
    assert renaming.converter is None and renaming.prefix == prefix
    assert renaming.unused == (prefix + "scaled_fp8",)
    for key, t in model.state_dict().items():
        assert renaming[key] == Renamed(tuple(t.shape), (Rows(prefix + key, 0, t.shape[0]),))


def test_missing_and_unexpected_are_reported():
    model = WAN.build()
    shapes = WAN.original_shapes(model)
    del shapes[f"{PREFIX}blocks.1.ffn.2.bias"]
    shapes[f"{PREFIX}scaled_fp8"] = ()
    renaming = diffusers_names(WAN.model_class, model.config, shapes, list(model.state_dict()))
    assert renaming.missing == ("blocks.1.ffn.net.2.bias",)
    assert renaming.unexpected == ("scaled_fp8",)
    assert renaming.unused == (f"{PREFIX}scaled_fp8",)


class Custom(torch.nn.Module):
    """A model class diffusers has no single-file conversion for."""


def test_a_class_without_a_converter_is_refused():
    with pytest.raises(CheckpointError, match=r"no single-file conversion for Custom.*\(diffusers\) names"):
        diffusers_names(Custom, {}, {"blocks.0.q.weight": (4, 4)}, ["blocks.0.to_q.weight"])


def _custom(monkeypatch, convert):
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "Custom", {"checkpoint_mapping_fn": convert})


SHAPES = {"w": (6, 4), "b": (6,), "s": ()}


def test_a_traced_converter_of_a_custom_class(monkeypatch):
    """Renames, row choices and a 0-d tensor, through a converter given the config as diffusers gives it."""
    seen = {}

    def convert(checkpoint, config, **_):
        seen.update(config)
        w = checkpoint.pop("w")
        return {"first": w[:2], "last": torch.cat([w[4:], w[2:4]]), "bias": checkpoint["b"], "scale": checkpoint["s"]}

    _custom(monkeypatch, convert)
    renaming = diffusers_names(Custom, {"width": 4}, SHAPES, ["first", "last", "bias", "scale", "absent"])
    assert seen == {"width": 4}
    assert renaming["first"] == Renamed((2, 4), (Rows("w", 0, 2),))
    assert renaming["last"] == Renamed((4, 4), (Rows("w", 4, 6), Rows("w", 2, 4)))
    assert renaming["bias"] == Renamed((6,), (Rows("b", 0, 6),))
    assert renaming["scale"] == Renamed((), (Rows("s", 0, 1),))
    assert renaming.missing == ("absent",) and renaming.unused == ()


UNTRACEABLE = {
    "transpose": (lambda c: {"out": c["w"].t()}, "a reshape"),
    "split along dim 1": (lambda c: {"out": c["w"][:, :2]}, "a reshape"),
    "flatten": (lambda c: {"out": c["w"].reshape(-1)}, "a reshape"),
    "mixes dims": (lambda c: {"out": c["w"] + torch.arange(4.0)}, "other than the first"),
    "scale": (lambda c: {"out": c["b"] * 2}, "new values"),
    "shift": (lambda c: {"out": c["b"] + 1}, "new values"),
    "sum of rows": (lambda c: {"out": c["b"][:3] + c["b"][3:]}, "new values"),
    "in place": (lambda c: {"out": c["b"].mul_(3)}, "new values"),
    "cast": (lambda c: {"out": c["w"].float()}, "a torch.float32 tensor"),
    "not a tensor": (lambda c: {"out": 3}, "makes a int value"),
    "0-d from a row": (lambda c: {"out": c["b"][0]}, "a reshape"),
}


@pytest.mark.parametrize("case", list(UNTRACEABLE))
def test_what_the_trace_cannot_follow_is_refused(monkeypatch, case):
    convert, why = UNTRACEABLE[case]
    _custom(monkeypatch, lambda checkpoint, **_: convert(checkpoint))
    with pytest.raises(CheckpointError, match=rf"Custom's 'out'.*{why}|{why}.*Custom's 'out'"):
        diffusers_names(Custom, {}, SHAPES, ["out"])


def test_a_converter_that_fails_is_refused(monkeypatch):
    def convert(checkpoint, **_):
        return {"out": checkpoint.pop("double_blocks.0.img_attn.qkv.weight")}

    _custom(monkeypatch, convert)
    with pytest.raises(CheckpointError, match=r"could not convert.*Custom.*KeyError") as raised:
        diffusers_names(Custom, {}, SHAPES, ["out"])
    assert isinstance(raised.value.__cause__, KeyError)


def test_a_file_of_another_model_is_refused():
    model = WAN.build()
    with pytest.raises(CheckpointError, match="none of WanTransformer3DModel's tensors"):
        diffusers_names(WAN.model_class, model.config, {"something.else": (3, 3)}, list(model.state_dict()))
    model = FLUX.build()
    with pytest.raises(CheckpointError, match="FluxTransformer2DModel"):
        diffusers_names(FLUX.model_class, model.config, WAN.original_shapes(WAN.build()), list(model.state_dict()))


def test_concatenations_of_rows_stay_expanded():
    """What a converter concatenates costs a float per row: 2 x 40 GB of float64 views, cat and cloned, in no
    memory."""
    big = torch.arange(100_000, dtype=torch.float64)[:, None].expand(100_000, 50_000)
    with _LazyRows():
        joined = torch.cat([big[50_000:], big[:50_000], big], dim=0)
        copied = joined.clone()
    assert joined.shape == copied.shape == (200_000, 50_000)
    assert joined.stride(1) == copied.stride(1) == 0
    assert joined[:, 0][:3].tolist() == [50_000, 50_001, 50_002] and joined[150_000, 7] == 50_000
