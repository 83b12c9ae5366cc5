"""Community files made in code for tests: a Wan 2.2 pipeline folder whose two transformers are given as GGUF files
written the way the community's tools write them (city96's converter: the original checkpoint's key names, a mix of
types, small and 1-D tensors in F32), with the output of the independent reference (gguf-py's dequantization, mapped
by diffusers' own converter) and of ``model_full_load`` on the same files.

The transformers are 256 wide (2 heads of 128), so that every GGML type, the K types' 256-value super-blocks
included, quantizes some of their layers. Built once per session (``gguf_pipeline()``).

The same pipeline with its transformers given as ComfyUI fp8 files (``comfy_files``: legacy "fp8 scaled",
``_quantization_metadata``, plain e4m3fn and e5m2 casts), under the original names too, with the output of the
independent reference (``q.float() * scale`` of what the writer stored, mapped by diffusers' own converter) and of
``model_full_load`` on each form's files: ``comfy_fp8_pipeline()``, built once per session.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, WanTransformer3DModel
from gguf import GGMLQuantizationType as Q

import memmode_core as memmode
from comfy_files import E4M3, E5M2, write_legacy_scaled, write_metadata_scaled, write_plain_fp8
from gguf_files import reference_dequantize, write_gguf
from memmode_core.quantization import packed_record
from original_checkpoints import PREFIX, to_original, wan_plan
from tiny_components import WAN_TRANSFORMER
from tiny_pipelines import make_pipeline, run

FAMILY = "wan22"
#: the tiny Wan transformer made 256 wide (2 heads of 128), so that the K types' super-blocks fit its rows
WIDE_WAN = {**WAN_TRANSFORMER, "attention_head_dim": 128, "ffn_dim": 256, "freq_dim": 256}
#: how a wide Wan transformer's forward sums (for ``helpers.assert_reassociated``): no sum longer than its width,
#: 256 (2 heads of 128; ffn 256; freq 256), and in sequence the time and text embedders (4), then per block self-
#: and cross-attention (projections, scores, values, output: 8) and the feed-forward (2), twice, and the output
#: projection: 25 sums
WIDE_WAN_FORWARD = {"length": 256, "depth": 25}
#: a call of the pipeline: two steps of one of the transformers (the VAE and the text encoder compute with the
#: same operands in every test that uses this: their sums carry the transformers' differences, adding none)
WIDE_WAN_CALL = {"length": 256, "depth": 2 * WIDE_WAN_FORWARD["depth"]}
#: the types given to the transformers' tensors in turn (city96's converter keeps small and 1-D ones F32)
TYPES = (
    Q.Q8_0,
    Q.Q4_K,
    Q.Q6_K,
    Q.Q5_0,
    Q.Q4_0,
    Q.Q5_K,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_1,
    Q.Q5_1,
    Q.IQ4_NL,
    Q.IQ4_XS,
    Q.F16,
    Q.BF16,
)


def wide_wan_pipeline():
    """The tiny Wan 2.2 pipeline with both transformers :data:`WIDE_WAN`, every weight drawn from N(0, 0.05) (no
    zero-initialised output layer: every layer shows in the output); the same weights on every call."""
    pipe = make_pipeline(FAMILY)
    for index, name in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(100 + index)
        model = WanTransformer3DModel(**WIDE_WAN).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.05)
        setattr(pipe, name, model)
        pipe.register_modules(**{name: model})
    return pipe


#: the offloading placements a community file runs under in the tests, with their options, and the storages
PLACEMENTS = [
    ("model_cpu_offload", {}),
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("sequential_cpu_offload", {}),
]
STORAGES = ["ram", "disk", "mmap"]


def wan_inputs() -> dict:
    """One call of a wide Wan transformer alone: a 1 x 8 x 8 latent, 16 text tokens, step 500 (seeded)."""
    return {
        "hidden_states": torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(0)),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1)),
        "return_dict": False,
    }


class GgufPipeline:
    """The folder (configs, the other components' weights), the two GGUF files, and the reference output."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="memmode-gguf-pipeline-"))
        atexit.register(shutil.rmtree, self.folder, True)
        pipe = wide_wan_pipeline()
        pipe.save_pretrained(self.folder)
        self.files: dict[str, Path] = {}
        self.types: dict[str, dict[str, Q]] = {}
        for index, name in enumerate(("transformer", "transformer_2")):
            state = getattr(pipe, name).state_dict()
            original = to_original(wan_plan(list(state)), state)
            # the types in turn (each expert from another one) over the matrices whose rows fit a K type's
            # super-block, Q8_0 for the others
            wide = [key for key, value in original.items() if value.dim() == 2 and value.shape[1] % 256 == 0]
            asked = {key: TYPES[(i + len(TYPES) // 2 * index) % len(TYPES)] for i, key in enumerate(wide)}
            tensors = {key: (value.float().numpy(), asked.get(key, Q.Q8_0)) for key, value in original.items()}
            path = self.folder / f"{name}-mixed.gguf"
            self.types[name] = write_gguf(path, tensors, arch="wan", keep_f32=(".modulation",))
            self.files[name] = path
        self.reference = self._reference()

    def files_kwargs(self) -> dict[str, str]:
        return {name: str(path) for name, path in self.files.items()}

    def _reference(self) -> torch.Tensor:
        """The pipeline with each transformer's weights set to gguf-py's dequantization of its file, mapped to
        diffusers' names by diffusers' own converter: the independent reference."""
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        pipe = DiffusionPipeline.from_pretrained(self.folder)
        pipe.set_progress_bar_config(disable=True)
        for name, path in self.files.items():
            values = reference_dequantize(path)
            values = convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): v for k, v in values.items()})
            getattr(pipe, name).load_state_dict(values, strict=True)
        return run(pipe, FAMILY)


_MADE: list[GgufPipeline] = []


def gguf_pipeline() -> GgufPipeline:
    """The session's GGUF pipeline (made on first use)."""
    if not _MADE:
        _MADE.append(GgufPipeline())
    return _MADE[0]


def load(gguf_pipeline: GgufPipeline, mode: str, **kwargs):
    """``memmode.load`` of the folder with both transformers from their GGUF files, on the CPU, in float32 (the
    reference's dtype) unless told otherwise."""
    kwargs.setdefault("torch_dtype", torch.float32)
    return memmode.load(gguf_pipeline.folder, mode, device="cpu", **gguf_pipeline.files_kwargs(), **kwargs)


_FULL: dict[str, torch.Tensor] = {}


def full_load_output(gguf_pipeline: GgufPipeline) -> torch.Tensor:
    """Call 1 of the pipeline loaded from the files under ``model_full_load``: what every lossless mode must give."""
    if "out" not in _FULL:
        handle = load(gguf_pipeline, "model_full_load")
        handle.target.set_progress_bar_config(disable=True)
        _FULL["out"] = run(handle.target, FAMILY)
    return _FULL["out"]


def packed_layers(module: torch.nn.Module) -> dict[str, str]:
    """layer path -> packed format, for every packed layer of ``module``."""
    return {path: record.format for path, sub in module.named_modules() if (record := packed_record(sub)) is not None}


# -- the same pipeline with its transformers as ComfyUI fp8 files ---------------------------------------------------


def _write_legacy(path: Path, state: dict) -> dict:
    return write_legacy_scaled(path, state)


def _write_metadata(path: Path, state: dict) -> dict:
    return write_metadata_scaled(path, state)


def _write_plain_e4m3(path: Path, state: dict) -> dict:
    return write_plain_fp8(path, state, fp8=E4M3)


def _write_plain_e5m2(path: Path, state: dict) -> dict:
    return write_plain_fp8(path, state, fp8=E5M2)


#: the forms ComfyUI's fp8 files come in (``comfy_files``), by name: how each writes a transformer's file. Each
#: writer quantizes every 2-D ``.weight`` (the linear layers; Wan's patch embedding is a 5-D convolution) and
#: returns, for each, the float8 tensor and the scale it stored (None for a plain cast)
COMFY_FORMS = {
    "legacy_scaled": _write_legacy,
    "metadata_scaled": _write_metadata,
    "plain_e4m3fn": _write_plain_e4m3,
    "plain_e5m2": _write_plain_e5m2,
}


class ComfyFp8Pipeline:
    """The Wan 2.2 pipeline of :class:`GgufPipeline` (the same 256-wide transformers, the same seeds), its two
    transformers written as ComfyUI fp8 safetensors files under the original checkpoint's names
    (``model.diffusion_model.`` included), one pair of files per form of :data:`COMFY_FORMS`; per form, the
    independent reference output (``q.float() * scale`` of what the writer stored, mapped to diffusers' names by
    diffusers' own converter) and the output of ``model_full_load`` on the same files, each computed once."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="memmode-comfy-fp8-pipeline-"))
        atexit.register(shutil.rmtree, self.folder, True)
        pipe = wide_wan_pipeline()
        pipe.save_pretrained(self.folder)
        #: transformer -> its state dict under the original names (float32)
        self.originals: dict[str, dict[str, torch.Tensor]] = {}
        for name in ("transformer", "transformer_2"):
            state = getattr(pipe, name).state_dict()
            self.originals[name] = to_original(wan_plan(list(state)), state)
        #: form -> transformer -> the file
        self.files: dict[str, dict[str, Path]] = {}
        #: form -> transformer -> original key -> (the float8 tensor, its scale or None), as the writer stored them
        self.stored: dict[str, dict[str, dict]] = {}
        for form, write in COMFY_FORMS.items():
            self.files[form], self.stored[form] = {}, {}
            for name, original in self.originals.items():
                path = self.folder / f"{name}-{form}.safetensors"
                self.stored[form][name] = write(path, original)
                self.files[form][name] = path
        self._references: dict[str, torch.Tensor] = {}
        self._full: dict[str, torch.Tensor] = {}

    def files_kwargs(self, form: str) -> dict[str, str]:
        return {name: str(path) for name, path in self.files[form].items()}

    def meant(self, form: str, name: str) -> dict[str, torch.Tensor]:
        """The transformer's weights as the file of ``form`` means them, under diffusers' names: each float8
        weight ``q.float() * scale`` (``q.float()`` for a plain cast), every other tensor as written, mapped by
        diffusers' own converter."""
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        values = dict(self.originals[name])
        for key, (q, scale) in self.stored[form][name].items():
            values[key] = q.float() if scale is None else q.float() * scale
        return convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): v for k, v in values.items()})

    def fp8_layers(self, form: str, name: str) -> set[str]:
        """The paths, in diffusers' model, of the layers whose weight the file of ``form`` stores in float8."""
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        mapped = convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): 0 for k in self.stored[form][name]})
        return {key.removesuffix(".weight") for key in mapped}

    def reference(self, form: str) -> torch.Tensor:
        """The pipeline with each transformer holding :meth:`meant`: the independent reference (computed once)."""
        if form not in self._references:
            pipe = DiffusionPipeline.from_pretrained(self.folder)
            pipe.set_progress_bar_config(disable=True)
            for name in self.originals:
                getattr(pipe, name).load_state_dict(self.meant(form, name), strict=True)
            self._references[form] = run(pipe, FAMILY)
        return self._references[form]

    def load(self, form: str, mode: str, **kwargs):
        """``memmode.load`` of the folder with both transformers from their files of ``form``, on the CPU, in
        float32 (the reference's dtype) unless told otherwise."""
        kwargs.setdefault("torch_dtype", torch.float32)
        return memmode.load(self.folder, mode, device="cpu", **self.files_kwargs(form), **kwargs)

    def full_load_output(self, form: str) -> torch.Tensor:
        """Call 1 of the pipeline loaded from the files of ``form`` under ``model_full_load`` (computed once):
        what every lossless mode on the same files must give."""
        if form not in self._full:
            handle = self.load(form, "model_full_load")
            handle.target.set_progress_bar_config(disable=True)
            self._full[form] = run(handle.target, FAMILY)
        return self._full[form]


_MADE_FP8: list[ComfyFp8Pipeline] = []


def comfy_fp8_pipeline() -> ComfyFp8Pipeline:
    """The session's ComfyUI fp8 pipeline (made on first use)."""
    if not _MADE_FP8:
        _MADE_FP8.append(ComfyFp8Pipeline())
    return _MADE_FP8[0]


# -- LoRA adapters of the wide Wan -------------------------------------------------------------------------


@cache
def lora_targets() -> tuple[tuple[str, int, int], ...]:
    """``(path, in, out)`` of the attention projections of the fixture's (256 wide) Wan transformer: read from a
    model on the meta device, never from a loaded one (whose layers an adapter wraps)."""
    with torch.device("meta"):
        model = WanTransformer3DModel(**WIDE_WAN)
    pattern = re.compile(r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)")
    return tuple(
        (name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and pattern.fullmatch(name)
    )


def make_lora(seed: int, rank: int = 4, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A random LoRA of the attention layers in diffusers' (peft) layout, as ``tiny_loras`` makes them (no alpha:
    the update is exactly ``lora_B @ lora_A``); fresh tensors on every call."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, width, height in lora_targets():
        state[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, width, generator=generator) / width**0.5
        state[f"transformer.{name}.lora_B.weight"] = torch.randn(height, rank, generator=generator) * (
            scale / rank**0.5
        )
    return state
