"""Quantized diffusers folders made in code for tests, the way users get them: the tiny Wan 2.2 pipeline of the
community-file suites (two 256-wide transformers) saved with ``save_pretrained``, its two transformers then quantized
by NVIDIA's Model Optimizer on the CPU (``mtq.quantize`` with a calibration forward) and each written by modelopt's
own ``export_hf_checkpoint`` into its folder — what NVIDIA publishes its Wan 2.2 A14B checkpoints as. The text
encoder and the VAE stay plain: a pipeline where only some components are quantized.

One folder per algorithm of :data:`ALGORITHMS` (modelopt's preset configs: FP8 per tensor, FP8 per channel, FP8 in
128x128 blocks, NVFP4; the FP8 one written in shards), made once per session (``modelopt_folder(name)``), with the
reference: each quantized weight as modelopt's own ``FP8QTensor`` / ``NVFP4QTensor.dequantize`` gives it in float32
(``modelopt_dequantize``).

diffusers' own road (``diffusers_modelopt_folder``): ``from_pretrained(quantization_config=NVIDIAModelOptConfig(...))``
then ``save_pretrained`` — no export — which writes modelopt's quantizer state (``_amax``), not quantized weights.
diffusers 0.42 builds its default modelopt config from a table modelopt 0.47 keeps as a list, so the fixture gives it
``modelopt_config`` (FP8 weights, per tensor) as its docs allow.

A transformers component quantized so (``fp8_text_encoder_folder``): modelopt 0.47's export of a transformers model
fails on the CPU (it passes a dtype where a device goes), so the UMT5 text encoder's linear layers are written in the
format that export defines — each weight quantized by modelopt's own ``FP8QTensor.quantize`` (per tensor), its
``weight_scale`` beside it, ``quant_algo`` FP8 in config.json — under transformers' names, the tied embedding once.
"""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors import safe_open

from community_pipelines import FAMILY, wan_inputs, wide_wan_pipeline
from tiny_pipelines import run

mtq = pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt writes the ModelOpt fixtures")

#: fixture name -> modelopt's preset config of it
ALGORITHMS = {
    "fp8": "FP8_DEFAULT_CFG",
    "fp8_per_channel": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "fp8_blockwise": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
}
#: the algorithm whose export is sharded (diffusers' index and shards, as a large model's is), and its shard size
SHARDED, SHARD_SIZE = "fp8", "300KB"
#: the components modelopt quantizes
QUANTIZED = ("transformer", "transformer_2")
#: FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG's blocks, NVFP4's
FP8_BLOCK, NVFP4_BLOCK = 128, 16


class ModelOptFolder:
    """A pipeline folder whose ``transformer`` modelopt exported quantized with one algorithm."""

    def __init__(self, name: str, base: Path) -> None:
        from modelopt.torch.export import export_hf_checkpoint

        self.name = name
        self.folder = Path(tempfile.mkdtemp(prefix=f"memmode-modelopt-{name}-"))
        atexit.register(shutil.rmtree, self.folder, True)
        shutil.copytree(base, self.folder, dirs_exist_ok=True)
        for component in QUANTIZED:
            model = copy.deepcopy(getattr(base_pipeline(), component))
            mtq.quantize(model, copy.deepcopy(getattr(mtq, ALGORITHMS[name])), _calibrate)
            shutil.rmtree(self.folder / component)
            shards = {"max_shard_size": SHARD_SIZE} if name == SHARDED else {}
            export_hf_checkpoint(model, export_dir=self.folder / component, **shards)
        #: the layers modelopt quantized (those with a weight scale; the same in both transformers)
        self.layers = sorted(k.removesuffix(".weight_scale") for k in self.tensors() if k.endswith(".weight_scale"))

    def shards(self, component: str = "transformer") -> list[Path]:
        """The component's safetensors files (one, or the shards its index names)."""
        return sorted((self.folder / component).glob("*.safetensors"))

    def tensors(self, component: str = "transformer") -> dict[str, torch.Tensor]:
        tensors = {}
        for shard in self.shards(component):
            with safe_open(shard, "pt") as file:
                tensors.update((key, file.get_tensor(key)) for key in file.keys())
        return tensors

    def reference(self) -> torch.Tensor:
        """The pipeline's output with the transformers holding modelopt's own dequantization of each quantized
        weight (float32) and the export's other tensors: the independent reference."""
        pipe = DiffusionPipeline.from_pretrained(_base_folder(), torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        for component in QUANTIZED:
            tensors, model = self.tensors(component), getattr(pipe, component)
            state = model.state_dict()
            for key in state:
                layer = key.removesuffix(".weight")
                state[key] = modelopt_dequantize(tensors, layer) if layer in self.layers else tensors[key]
            model.load_state_dict(state, strict=True)
        return run(pipe, FAMILY)


def modelopt_dequantize(tensors: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """``layer``'s weight as modelopt dequantizes it, in float32 (its ``QTensor`` classes)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    weight, scale = tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"]
    if weight.dtype == torch.float8_e4m3fn:
        rows, columns = weight.shape
        qtensor = FP8QTensor(weight.shape, torch.float32, weight)
        if scale.numel() == 1 or scale.numel() == rows:
            return qtensor.dequantize(dtype=torch.float32, scale=scale.reshape(-1, 1) if scale.numel() > 1 else scale)
        grid = (-(-rows // FP8_BLOCK), -(-columns // FP8_BLOCK))
        blocks = {-1: FP8_BLOCK, -2: FP8_BLOCK}
        return qtensor.dequantize(dtype=torch.float32, scale=scale.reshape(grid), block_sizes=blocks)
    shape = torch.Size((weight.shape[0], weight.shape[1] * 2))
    return NVFP4QTensor(shape, torch.float32, weight).dequantize(
        dtype=torch.float32,
        scale=scale,
        double_scale=tensors[f"{layer}.weight_scale_2"],
        block_sizes={-1: NVFP4_BLOCK},
    )


def _calibrate(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model(**wan_inputs())


_BASE: list[Path] = []
_PIPE: list = []


def base_pipeline():
    """The tiny Wan 2.2 pipeline the folders are made from (its weights as saved in the base folder), made once."""
    if not _PIPE:
        _PIPE.append(wide_wan_pipeline())
    return _PIPE[0]


def _base_folder() -> Path:
    if not _BASE:
        folder = Path(tempfile.mkdtemp(prefix="memmode-modelopt-base-"))
        atexit.register(shutil.rmtree, folder, True)
        base_pipeline().save_pretrained(folder)
        _BASE.append(folder)
    return _BASE[0]


_MADE: dict[str, ModelOptFolder] = {}


def modelopt_folder(name: str) -> ModelOptFolder:
    """The session's folder of algorithm ``name`` (made on first use)."""
    if name not in _MADE:
        _MADE[name] = ModelOptFolder(name, _base_folder())
    return _MADE[name]


_TEXT: list[Path] = []


def fp8_text_encoder_folder() -> Path:
    """The FP8 folder with its text encoder quantized too (see the module docstring), made once."""
    from modelopt.torch.quantization.qtensor import FP8QTensor
    from safetensors.torch import save_file

    if not _TEXT:
        folder = Path(tempfile.mkdtemp(prefix="memmode-modelopt-text-encoder-"))
        atexit.register(shutil.rmtree, folder, True)
        shutil.copytree(modelopt_folder("fp8").folder, folder, dirs_exist_ok=True)
        encoder = base_pipeline().text_encoder
        tensors = {}
        with safe_open(folder / "text_encoder" / "model.safetensors", "pt") as file:
            metadata = file.metadata()
            for key in file.keys():
                tensors[key] = file.get_tensor(key)
        for path, module in encoder.named_modules():
            if isinstance(module, torch.nn.Linear):
                qtensor, scale = FP8QTensor.quantize(module.weight.detach().float())
                tensors[f"{path}.weight"] = qtensor._quantized_data
                tensors[f"{path}.weight_scale"] = scale.float().reshape(())
        save_file(tensors, folder / "text_encoder" / "model.safetensors", metadata=metadata)
        config_path = folder / "text_encoder" / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "producer": {"name": "modelopt", "version": "0.47.0"},
        }
        config_path.write_text(json.dumps(config))
        _TEXT.append(folder)
    return _TEXT[0]


_DIFFUSERS: list[Path] = []


def diffusers_modelopt_folder() -> Path:
    """The pipeline with its transformer quantized by diffusers' NVIDIAModelOptConfig, saved by save_pretrained."""
    from diffusers import NVIDIAModelOptConfig, WanTransformer3DModel

    if not _DIFFUSERS:
        folder = Path(tempfile.mkdtemp(prefix="memmode-modelopt-diffusers-"))
        atexit.register(shutil.rmtree, folder, True)
        shutil.copytree(_base_folder(), folder, dirs_exist_ok=True)
        weights_only = {"*weight_quantizer": {"num_bits": (4, 3), "axis": None}, "*input_quantizer": {"enable": False}}
        config = NVIDIAModelOptConfig(quant_type="FP8", modelopt_config={"quant_cfg": weights_only, "algorithm": "max"})
        model = WanTransformer3DModel.from_pretrained(folder / "transformer", quantization_config=config)
        shutil.rmtree(folder / "transformer")
        model.save_pretrained(folder / "transformer")
        _DIFFUSERS.append(folder)
    return _DIFFUSERS[0]
