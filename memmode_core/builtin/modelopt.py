"""The ``modelopt`` reader: model folders NVIDIA's Model Optimizer exported quantized (FP8, NVFP4).

``modelopt.torch.export.export_hf_checkpoint`` of a quantized diffusers model (NVIDIA publishes its Wan 2.2 and Flux
checkpoints so) writes the model's folder with ``"quantization_config": {"quant_method": "modelopt", "quant_algo":
...}`` in ``config.json`` and, for each linear layer it quantized, beside the layer's plain tensors:

- **FP8** (``quant_algo`` ``FP8``, ``FP8_PER_CHANNEL_PER_TOKEN``, ``FP8_PB_WO``): ``<layer>.weight`` in
  ``float8_e4m3fn`` and a float32 ``<layer>.weight_scale`` — one element (per tensor), one per output row
  (per channel), or one per square block of rows and columns (``FP8_PB_WO``: ``[ceil(rows / b), 1, ceil(columns /
  b), 1]``, the last blocks cut short); the weight is ``fp8 * scale`` (modelopt's ``FP8QTensor.dequantize``);
- **NVFP4** (``NVFP4``, ``W4A16_NVFP4``): ``<layer>.weight`` ``uint8`` ``[rows, columns / 2]``, two E2M1 codes a
  byte, the low nibble first; ``<layer>.weight_scale`` ``float8_e4m3fn`` ``[rows, columns / 16]``, a scale per block
  of 16 codes of a row; ``<layer>.weight_scale_2``, a float32 scale of the whole tensor; the weight is ``e2m1 *
  (block scale * tensor scale)`` (modelopt's ``NVFP4QTensor.dequantize``: the two scales multiplied first);
- ``MIXED_PRECISION``: the layers' algorithms, each as above, in ``quantized_layers``;
- ``<layer>.input_scale`` (and ``output_scale``, ``k_scale``, ``v_scale``): activation scales for fp8/fp4
  matmuls — not the model's, and left out: memmode computes the layer in a float dtype.

Each quantized weight is an encoded tensor decoded by a codec here, in float32 and rounded once to the compute
dtype, a band of rows at a time (:func:`~memmode_core.quantization.row_bands.decode_by_rows`: a large layer's
float32 values are never all alive): in float32 the value is modelopt's own dequantization bit for bit (its float32
products, in its order).
The float8 bytes are bound viewed as ``uint8`` (a packed layer's parts keep their bytes under every placement).
What is refused, naming the folder and the tensor, before anything is bound: an algorithm not read here (AWQ's and
SVDQuant's activation pre-scales, INT4/INT8, MXFP4/MXFP8, W4A8), a scale of the wrong shape or dtype, a scale that
is not finite (the per-tensor, per-channel, blockwise and tensor scales are read to check; NVFP4's block scales,
1/16 of the weight, are not), and a folder diffusers' ``save_pretrained`` wrote of a model quantized with
``NVIDIAModelOptConfig`` instead of modelopt's export (modelopt's quantizer state: its ``_amax`` calibration beside the
weights, which on the CPU stay unquantized; only modelopt's own quantized layers make weights of it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, QuantizedFolder, Reader, StoredTensor
from memmode_core.contracts.versions import KIT_VERSION
from memmode_core.quantization.microscaling import e2m1_to_float, scale_blocks
from memmode_core.quantization.row_bands import decode_by_rows

SCALE = "weight_scale"
#: NVFP4's scale of the whole tensor
TENSOR_SCALE = "weight_scale_2"
#: the activation scales modelopt exports beside a quantized layer: not the model's
ACTIVATION_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")
#: the block size of ``FP8_PB_WO`` (modelopt's ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``), where shapes cannot tell it
FP8_BLOCK = 128
#: NVFP4's values per block scale, where the config does not say
NVFP4_BLOCK = 16
#: modelopt's algorithm names (``modelopt.torch.export.model_config``), lower-cased, by the family read here
FP8_ALGOS = ("fp8", "fp8_per_channel_per_token", "fp8_pc_pt", "fp8_pb_wo")
NVFP4_ALGOS = ("nvfp4", "w4a16_nvfp4")
MIXED = "mixed_precision"
#: why an algorithm modelopt exports is not read
NOT_READ = {
    "nvfp4_awq": "its AWQ pre_quant_scale multiplies each layer's input before the matmul",
    "nvfp4_svd": "SVDQuant adds a low-rank branch and an input pre-scale to each layer",
    "nvfp4_svdquant": "SVDQuant adds a low-rank branch and an input pre-scale to each layer",
    "int4_awq": "its AWQ pre_quant_scale multiplies each layer's input before the matmul",
    "w4a8_awq": "its AWQ pre_quant_scale multiplies each layer's input before the matmul",
    "int8_sq": "SmoothQuant's int8 weights come with activation smoothing",
    "int8_wo": "modelopt's int8 weight-only export is not read yet",
    "w4a8_nvfp4_fp8": "its weights are decoded to fp8 by the kernel before a fp8 matmul",
    "mxfp8": "modelopt's MXFP8 export is not read yet",
    "mxfp4": "modelopt's MXFP4 export is not read yet",
    "w4a8_mxfp4_fp8": "modelopt's MXFP4 export is not read yet",
    "fp8_pb_real": "its block scales are kept for a real-quantized fp8 matmul",
}
#: the dtypes a per-tensor, per-channel or block scale may have (each exact in float32)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ModelOptFloat8(Quantizer):
    """ModelOpt's FP8 weight: ``float8_e4m3fn`` bytes (as ``uint8``) times a float ``weight_scale`` of one element,
    one per row, or — ``block`` set — one per ``block x block`` block (``[ceil(rows / block), ceil(columns /
    block)]``). Computed in float32, rounded once to ``dtype``."""

    packs = False

    def __init__(self, block: int | None = None) -> None:
        self.block = block
        self.name = self.format = "modelopt_fp8" if block is None else f"modelopt_fp8_block{block}"
        self.description = "ModelOpt FP8 weights with a float32 scale per " + (
            "tensor or row" if block is None else f"{block}x{block} block"
        )

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        payload = packed[PAYLOAD].view(torch.float8_e4m3fn).reshape(shape)
        scale = packed[SCALE].to(device=payload.device, dtype=torch.float32)
        rows, columns = shape
        if self.block is not None and scale.numel() > 1:
            # each row's scales ([rows, columns / block]: small), then each value times its block's, once
            grid = scale.reshape(-(-rows // self.block), -(-columns // self.block))
            per_row = grid.repeat_interleave(self.block, 0)[:rows]
        elif scale.numel() == 1:
            per_row = None
        else:  # one per row (of a row split, the split's rows)
            per_row = scale.reshape(rows, 1)

        def decode(band: slice) -> torch.Tensor:
            # a fresh float32 tensor (the dtype changes), multiplied in place: one allocation per band
            values = payload[band].to(torch.float32)
            if per_row is None:
                return values.mul_(scale.reshape(()))
            return _times_row_blocks(values, per_row[band], columns if self.block is None else self.block)

        return decode_by_rows(shape, dtype, decode)


def _times_row_blocks(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``values`` (``[rows, columns]``) times ``scales`` (``[rows, ceil(columns / block)]``), one per run of
    ``block`` columns of a row, the last run cut short; in place, each value multiplied once, as modelopt's
    dequantization does."""
    rows, columns = values.shape
    if columns == scales.shape[1] * block:  # whole runs: a broadcast over a view, nothing expanded
        values.view(rows, scales.shape[1], block).mul_(scales[:, :, None])
        return values
    return values.mul_(scales.repeat_interleave(block, 1)[:, :columns])


class ModelOptNVFP4(Quantizer):
    """ModelOpt's NVFP4 weight: E2M1 codes two a byte, the low nibble first; an fp8 E4M3 scale (as ``uint8``) per
    block of ``block`` codes of a row; a float32 scale of the whole tensor. ``code * (block scale * tensor scale)``,
    in float32, rounded once to ``dtype``."""

    packs = False

    def __init__(self, block: int = NVFP4_BLOCK) -> None:
        self.block = block
        self.name = self.format = "modelopt_nvfp4" if block == NVFP4_BLOCK else f"modelopt_nvfp4_block{block}"
        self.description = f"ModelOpt NVFP4 weights: E2M1 codes, fp8 scales per block of {block}, a tensor scale"

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        codes = packed[PAYLOAD]
        tensor = packed[TENSOR_SCALE].to(device=codes.device, dtype=torch.float32).reshape(())
        # the two scales multiplied first, as modelopt does: [rows, columns / block], 1/16 of the weight's values
        scales = packed[SCALE].view(torch.float8_e4m3fn).to(torch.float32).mul_(tensor)

        def decode(band: slice) -> torch.Tensor:
            return scale_blocks(e2m1_to_float(codes[band], high_nibble_first=False), scales[band], self.block)

        return decode_by_rows(shape, dtype, decode)


#: the codecs, shared by every folder read (one per block size met)
_CODECS: dict[tuple[str, int | None], Quantizer] = {}


def _codec(kind: str, block: int | None) -> Quantizer:
    codec = _CODECS.get((kind, block))
    if codec is None:
        codec = _CODECS[(kind, block)] = ModelOptFloat8(block) if kind == "fp8" else ModelOptNVFP4(block)
    return codec


class ModelOptReader(Reader):
    """Reads model folders ModelOpt exported quantized (see the module docstring)."""

    name = "modelopt"
    description = (
        "folders NVIDIA ModelOpt exported (export_hf_checkpoint: FP8 per tensor, per channel, 128x128 blocks; NVFP4): "
        "the quantized weights rest packed, decoded per forward as modelopt dequantizes them"
    )
    quant_methods = ("modelopt",)

    def read_folder(self, folder: QuantizedFolder) -> FileContents:
        config = folder.quantization_config
        algo = _algorithm(config, folder)
        layers = {key.removesuffix(f".{SCALE}") for key in folder.stored if key.endswith(f".{SCALE}")}
        encoded: dict[str, EncodedTensor] = {}
        stored: dict[str, StoredTensor] = {}  # the parts of encoded weights (float8 viewed as uint8), then the rest
        for layer in sorted(layers):
            layer_algo = _layer_algorithm(config, algo, layer, folder)
            tensor, parts = _layer(folder, layer, layer_algo, _group_size(config, layer))
            encoded[tensor.key] = tensor
            stored.update(parts)
        activations = {f"{layer}{suffix}" for layer in layers for suffix in ACTIVATION_SUFFIXES}
        for key, record in folder.stored.items():
            if key not in stored and key not in activations:
                stored[key] = record
        return FileContents(stored, encoded, metadata={"quant_algo": algo})

    def codecs(self) -> Mapping[str, Quantizer]:
        return _Codecs()


class _Codecs(Mapping[str, Quantizer]):
    """Every codec of this reader by format name, a block size read from the name (``modelopt_fp8_block128``):
    what a folder saved with ``save_quantized`` names, whichever block sizes this process has met."""

    def __getitem__(self, name: str) -> Quantizer:
        match = _FORMAT_NAME.fullmatch(name)
        if match is None:
            raise KeyError(name)
        kind, block = match["kind"], match["block"]
        if kind == "nvfp4":
            return _codec(kind, int(block) if block else NVFP4_BLOCK)
        return _codec(kind, int(block) if block else None)

    def __iter__(self):
        names = {_codec("fp8", None).format_name, _codec("nvfp4", NVFP4_BLOCK).format_name}
        return iter(sorted(names | {codec.format_name for codec in _CODECS.values()}))

    def __len__(self) -> int:
        return sum(1 for _ in self)


#: a codec's format name: its kind, and its block size where it is not the kind's default
_FORMAT_NAME = re.compile(r"modelopt_(?P<kind>fp8|nvfp4)(?:_block(?P<block>[1-9][0-9]*))?")


def _algorithm(config: Mapping[str, Any], folder: QuantizedFolder) -> str:
    algo = config.get("quant_algo")
    if algo is None:
        if "quant_type" in config or any(key.endswith("_quantizer._amax") for key in folder.stored):
            raise CheckpointError(
                f"{folder.where}: saved by diffusers' save_pretrained of a model quantized with NVIDIAModelOptConfig, "
                f"not by modelopt's export: it holds modelopt's quantizer state (its _amax calibration beside the "
                f"weights; on the CPU the weights stay unquantized), which only modelopt's own quantized layers turn "
                f"into the weights the model computes with. Load it with diffusers' from_pretrained (nvidia-modelopt "
                f"installed) and hand the pipeline to memmode.apply, or export the quantized model with "
                f"modelopt.torch.export.export_hf_checkpoint, whose folders memmode reads"
            )
        raise CheckpointError(
            f"{folder.where}: its modelopt quantization_config names no quant_algo ({dict(config)!r})"
        )
    if not isinstance(algo, str):
        raise CheckpointError(f"{folder.where}: its modelopt quant_algo is {algo!r}, not a name")
    return algo.lower()


def _layer_algorithm(config: Mapping[str, Any], algo: str, layer: str, folder: QuantizedFolder) -> str:
    if algo == MIXED:
        layers = config.get("quantized_layers") or {}
        entry = layers.get(layer)
        if not isinstance(entry, Mapping) or not isinstance(entry.get("quant_algo"), str):
            raise CheckpointError(
                f"{folder.where}: tensor {layer}.{SCALE} is a quantized layer's, and the MIXED_PRECISION config's "
                f"quantized_layers does not say how {layer!r} is quantized"
            )
        algo = entry["quant_algo"].lower()
    if algo in FP8_ALGOS or algo in NVFP4_ALGOS:
        return algo
    why = NOT_READ.get(algo, "memmode does not know it")
    raise CheckpointError(
        f"{folder.where}: layer {layer!r} is quantized with modelopt's {algo.upper()}, which memmode does not read "
        f"({why}). memmode reads FP8 (per tensor, per channel, blockwise) and NVFP4; load this folder with the "
        f"runtime modelopt exports for (TensorRT, vLLM), or quantize the original model with a memmode mode"
    )


def _group_size(config: Mapping[str, Any], layer: str) -> int | None:
    """NVFP4's block size as the config writes it (a MIXED_PRECISION layer's, else the weights' group_size)."""
    entry = (config.get("quantized_layers") or {}).get(layer)
    if isinstance(entry, Mapping) and isinstance(entry.get("group_size"), int):
        return entry["group_size"]
    for group in (config.get("config_groups") or {}).values():
        size = (group.get("weights") or {}).get("group_size") if isinstance(group, Mapping) else None
        if isinstance(size, int):
            return size
    return None


def _layer(
    folder: QuantizedFolder, layer: str, algo: str, group_size: int | None
) -> tuple[EncodedTensor, dict[str, StoredTensor]]:
    """One quantized layer's encoded weight and the records of its parts (float8 bytes viewed as ``uint8``)."""
    where = folder.where
    weight_key, scale_key = f"{layer}.weight", f"{layer}.{SCALE}"
    weight, scale = folder.stored.get(weight_key), folder.stored[scale_key]
    if weight is None:
        raise CheckpointError(f"{where}: tensor {scale_key!r} scales a weight {weight_key!r} the folder does not hold")

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: tensor {scale_key!r} ({algo.upper()}): {what}")

    if algo in FP8_ALGOS:
        if weight.dtype != torch.float8_e4m3fn or len(weight.shape) != 2:
            raise refuse(
                f"its weight {weight_key!r} is {list(weight.shape)} {weight.dtype}, not a float8_e4m3fn matrix"
            )
        rows, columns = weight.shape
        block = _fp8_scale_kind(scale, rows, columns, refuse)
        _check_finite(folder, scale_key, refuse)
        shape, codec = (rows, columns), _codec("fp8", block)
        parts = {PAYLOAD: weight_key, SCALE: scale_key}
        records = {weight_key: _as_bytes(weight), scale_key: scale}
    else:
        if weight.dtype != torch.uint8 or len(weight.shape) != 2:
            raise refuse(f"its weight {weight_key!r} is {list(weight.shape)} {weight.dtype}, not uint8 E2M1 pairs")
        rows, columns = weight.shape[0], weight.shape[1] * 2
        block = group_size or NVFP4_BLOCK
        if columns % block or scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (rows, columns // block):
            raise refuse(
                f"{list(scale.shape)} {scale.dtype}, where a [{rows}, {columns}] NVFP4 weight has float8_e4m3fn "
                f"scales [{rows}, {columns // block}] (one per block of {block})"
            )
        tensor_key = f"{layer}.{TENSOR_SCALE}"
        tensor_scale = folder.stored.get(tensor_key)
        if tensor_scale is None or tensor_scale.dtype not in SCALE_DTYPES or _numel(tensor_scale.shape) != 1:
            raise refuse(f"its tensor scale {tensor_key!r} is missing or not one float ({tensor_scale})")
        _check_finite(folder, tensor_key, refuse)
        shape, codec = (rows, columns), _codec("nvfp4", block)
        parts = {PAYLOAD: weight_key, SCALE: scale_key, TENSOR_SCALE: tensor_key}
        records = {weight_key: weight, scale_key: _as_bytes(scale), tensor_key: tensor_scale}
    return EncodedTensor(weight_key, shape, torch.float32, codec, parts), records


def _fp8_scale_kind(scale: StoredTensor, rows: int, columns: int, refuse) -> int | None:
    """None for a scale per tensor or per row, else the block size of a blockwise scale; anything else refused."""
    if scale.dtype not in SCALE_DTYPES:
        raise refuse(f"a {scale.dtype} scale, where modelopt writes float32")
    count = _numel(scale.shape)
    if count == 1 or tuple(scale.shape) in ((rows,), (rows, 1)):
        return None
    grid = tuple(scale.shape)
    if len(grid) == 4 and grid[1] == grid[3] == 1:  # modelopt keeps a blockwise amax as [rows/b, 1, columns/b, 1]
        grid = (grid[0], grid[2])
    if len(grid) == 2:
        block_rows, block_columns = grid
        blocks = [b for b in (FP8_BLOCK, *_exact_blocks(rows, columns, block_rows, block_columns)) if b > 0]
        for block in blocks:
            if (-(-rows // block), -(-columns // block)) == (block_rows, block_columns):
                return block
    raise refuse(
        f"{list(scale.shape)} scales for a [{rows}, {columns}] weight: neither one, one per row, nor one per square "
        f"block"
    )


def _exact_blocks(rows: int, columns: int, block_rows: int, block_columns: int) -> tuple[int, ...]:
    """The block size that tiles the weight exactly, if the scale's shape says one."""
    if block_rows and block_columns and rows % block_rows == 0 and columns % block_columns == 0:
        if rows // block_rows == columns // block_columns:
            return (rows // block_rows,)
    return ()


def _check_finite(folder: QuantizedFolder, key: str, refuse) -> None:
    value = folder.read(key)
    if not bool(torch.isfinite(value.to(torch.float32)).all()):
        raise refuse(f"{key!r} holds a value that is not finite")


def _as_bytes(record: StoredTensor) -> StoredTensor:
    """A float8 tensor's bytes as ``uint8`` (the dtype a packed layer's float8 parts rest in)."""
    return StoredTensor(record.key, torch.uint8, record.shape, record.start, record.end)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


#: the plugin kit this built-in reader is written against
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_readers(register):
    register(ModelOptReader())
