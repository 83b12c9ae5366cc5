"""Fixture writers: ComfyUI's safetensors files, from a state dict of float weights, for the ``comfy`` reader's tests
— the float8 forms of the community's reposts, and the mixed-precision files of every format ComfyUI defines.

Each writer quantizes the 2-D tensors (the linear weights: what ComfyUI's converters quantize) and keeps the
others as they are, and returns what it stored for each quantized weight — the float8 tensor and the scale —
so that a test computes the value the file means (``q.float() * scale``) without decoding it the reader's way.

- :func:`write_legacy_scaled`: ``<layer>.weight`` float8, ``<layer>.scale_weight`` float32, the ``scaled_fp8``
  marker, and ``<layer>.scale_input`` (Comfy-Org's "fp8_scaled" files, Kijai's ``_scaled_KJ`` ones);
- :func:`write_metadata_scaled`: ``<layer>.weight_scale`` and ``_quantization_metadata`` in the header
  (ComfyUI's QUANTIZATION.md), the weight as float8 or as its ``uint8`` container;
- :func:`write_plain_fp8`: float8 casts without a scale;
- :func:`write_comfy`: ComfyUI's mixed precision (nvfp4, mxfp8, int8, awq_w4a16, fp8 layers beside full-precision
  ones), each layer quantized by comfy-kitchen's eager backend (:func:`comfy_quantize`) and stored as ComfyUI
  saves it; :func:`dequantized` is comfy-kitchen's own dequantization, the reference;
- bad inputs: ``scales=`` replaces chosen scales (empty, NaN), ``extra=`` adds tensors (a scale without its
  weight), :func:`truncate` cuts a file short and :func:`damage_header` breaks its JSON.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


#: one layer config of each format and variant ComfyUI writes, by a test id -> (config, the codec's format name)
LAYER_FORMATS = {
    "nvfp4": ({"format": "nvfp4"}, "comfy_nvfp4"),
    "mxfp8": ({"format": "mxfp8"}, "comfy_mxfp8"),
    "int8_tensorwise": ({"format": "int8_tensorwise"}, "comfy_int8"),
    "int8_per_row": ({"format": "int8_tensorwise", "per_row": True}, "comfy_int8"),
    "int8_convrot": ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16}, "comfy_int8_convrot16"),
    "awq_w4a16": ({"format": "awq_w4a16", "group_size": 16}, "comfy_awq_w4a16"),
    "float8_e4m3fn": ({"format": "float8_e4m3fn"}, "comfy_fp8_e4m3fn"),
}
#: the layers of a mixed file, in turn: one of each format and variant
MIXED_LAYERS = [config for config, _ in LAYER_FORMATS.values()]


def tiny_state(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A small model's weights: two linear layers with biases around a layer norm, in ``dtype``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 8))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.1, 0.1)
    return {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}


def quantized_keys(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if k.endswith(".weight") and v.dim() == 2]


def scale_of(weight: torch.Tensor, fp8: torch.dtype = E4M3) -> torch.Tensor:
    """ComfyUI's per-tensor scale: the absolute maximum over the float8 type's largest value, in float32."""
    return (weight.float().abs().amax() / torch.finfo(fp8).max).reshape(())


def to_fp8(weight: torch.Tensor, scale: torch.Tensor | None, fp8: torch.dtype = E4M3) -> torch.Tensor:
    values = weight.float() if scale is None else weight.float() / scale
    return values.to(fp8).contiguous()


def write_legacy_scaled(
    path: Path,
    state: Mapping[str, torch.Tensor],
    *,
    fp8: torch.dtype = E4M3,
    scale_input: bool = True,
    marker: bool = True,
    scale_shape: tuple[int, ...] = (),
    scales: Mapping[str, torch.Tensor] | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The legacy "fp8 scaled" form; ``scales`` maps a weight key to the scale tensor to store instead."""
    tensors: dict[str, torch.Tensor] = {}
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, value in state.items():
        if key not in quantized_keys(state):
            tensors[key] = value
            continue
        layer = key.removesuffix(".weight")
        scale = scale_of(value, fp8)
        tensors[key] = to_fp8(value, scale, fp8)
        tensors[f"{layer}.scale_weight"] = scale.reshape(scale_shape)
        if scales is not None and key in scales:
            tensors[f"{layer}.scale_weight"] = scales[key]
        if scale_input:
            tensors[f"{layer}.scale_input"] = torch.tensor(1.0)
        stored[key] = (tensors[key], scale)
    if marker:
        tensors["scaled_fp8"] = torch.empty(0, dtype=fp8)
    tensors.update(extra or {})
    save_file(tensors, str(path))
    return stored


def write_metadata_scaled(
    path: Path,
    state: Mapping[str, torch.Tensor],
    *,
    fp8: torch.dtype = E4M3,
    container: bool = False,
    layer_names: Mapping[str, str] | None = None,
    formats: Mapping[str, object] | None = None,
    input_scale: bool = True,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The ``_quantization_metadata`` form. ``container`` stores each weight's float8 bytes as ``uint8``;
    ``layer_names`` maps a layer to the name the metadata gives it; ``formats`` maps a layer to the config the
    metadata declares (default ``{"format": "float8_e4m3fn"}``, or e5m2's)."""
    tensors: dict[str, torch.Tensor] = {}
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    layers: dict[str, object] = {}
    for key, value in state.items():
        if key not in quantized_keys(state):
            tensors[key] = value
            continue
        layer = key.removesuffix(".weight")
        scale = scale_of(value, fp8)
        q = to_fp8(value, scale, fp8)
        tensors[key] = q.view(torch.uint8) if container else q
        tensors[f"{layer}.weight_scale"] = scale
        if input_scale:
            tensors[f"{layer}.input_scale"] = torch.tensor(1.0)
        name = (layer_names or {}).get(layer, layer)
        layers[name] = (formats or {}).get(layer, {"format": f"float8_{str(fp8).split('_', 1)[1]}"})
        stored[key] = (q, scale)
    tensors.update(extra or {})
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    save_file(tensors, str(path), metadata=metadata)
    return stored


def write_plain_fp8(
    path: Path, state: Mapping[str, torch.Tensor], *, fp8: torch.dtype = E4M3
) -> dict[str, tuple[torch.Tensor, None]]:
    """Float8 casts of the linear weights, no scale (ComfyUI's "fp8_e4m3fn" downloads)."""
    tensors = dict(state)
    stored = {}
    for key in quantized_keys(state):
        tensors[key] = to_fp8(state[key], None, fp8)
        stored[key] = (tensors[key], None)
    save_file(tensors, str(path))
    return stored


def write_plain(path: Path, state: Mapping[str, torch.Tensor]) -> None:
    """An ordinary safetensors file: no float8 tensor (core's to read)."""
    save_file(dict(state), str(path))


def comfy_quant_marker(config: object) -> torch.Tensor:
    """A ``<layer>.comfy_quant`` tensor, as ComfyUI's ``convert_old_quants`` makes it: the JSON's bytes."""
    return torch.tensor(list(json.dumps(config).encode()), dtype=torch.uint8)


def truncate(path: Path, drop: int = 16) -> None:
    """Cut the last ``drop`` bytes off the file: the last tensor's byte range now runs past the end."""
    data = path.read_bytes()
    path.write_bytes(data[:-drop])


def damage_header(path: Path) -> None:
    """Overwrite the header's JSON in place (same length) so that it no longer parses."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length // 2 : 8 + length // 2 + 4] = b"\x00]]{"
    path.write_bytes(bytes(data))


# -- ComfyUI's mixed precision: every format, quantized by comfy-kitchen ---------------------------------------------

#: the comfy-kitchen layout each ComfyUI format quantizes with (comfy/quant_ops.py's QUANT_ALGOS), and its options
CK_LAYOUTS = {
    "float8_e4m3fn": ("TensorCoreFP8Layout", {}),
    "nvfp4": ("TensorCoreNVFP4Layout", {}),
    "mxfp8": ("TensorCoreMXFP8Layout", {}),
    "int8_tensorwise": ("TensorWiseINT8Layout", {}),
}
#: the formats whose parameters include an activation scale (ComfyUI writes it where the layer has one)
WITH_INPUT_SCALE = ("float8_e4m3fn", "nvfp4", "mxfp8")


def comfy_quantize(weight: torch.Tensor, config: Mapping) -> object:
    """``weight`` quantized in the format ``config`` declares, by comfy-kitchen's eager backend (ComfyUI's own
    kernels; ``comfy_kitchen.tensor.QuantizedTensor``): ``int8_tensorwise`` per row with ``"per_row": True`` and
    rotated with ``"convrot": True`` (``convrot_groupsize``); ``awq_w4a16`` is calibrated offline (comfy-kitchen
    does not quantize it), so its codes, scales and zero points are fitted here per group (``group_size``) and
    wrapped in comfy-kitchen's layout. Computed in float32, so that ``dequantize()`` is float32 too."""
    from comfy_kitchen.registry import registry
    from comfy_kitchen.tensor import QuantizedTensor

    weight = weight.float()
    fmt = config["format"]
    if fmt == "awq_w4a16":
        return _awq(weight, int(config.get("group_size", 64)))
    layout, options = CK_LAYOUTS[fmt]
    options = dict(options)
    if fmt == "int8_tensorwise" and (config.get("per_row") or config.get("convrot")):
        options.update(per_channel=True, convrot=bool(config.get("convrot")))
        options["convrot_groupsize"] = int(config.get("convrot_groupsize", 256))
    with registry.use_backend("eager"):
        return QuantizedTensor.from_float(weight, layout, **options)


def _awq(weight: torch.Tensor, group: int) -> object:
    """AWQ W4A16 codes of ``weight``: per group of ``group`` input columns and row, the range split in 15 steps,
    ``(code - 8) * scale + zero`` its values (scale and zero in bfloat16, as the community's files have them)."""
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreAWQW4A16Layout

    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    codes = ((groups - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1) + 8).round().clamp(0, 15)
    codes = codes.reshape(rows, columns).to(torch.uint8)
    qdata = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    params = TensorCoreAWQW4A16Layout.Params(
        scale=scale.t().contiguous(),
        orig_dtype=torch.float32,
        orig_shape=(rows, columns),
        zeros=zero.t().contiguous(),
        group_size=group,
    )
    return QuantizedTensor(qdata, "TensorCoreAWQW4A16Layout", params)


def write_comfy(
    path: Path,
    state: Mapping[str, torch.Tensor],
    layers: Mapping[str, Mapping],
    *,
    declare: str = "markers",
    input_scale: bool = True,
    e8m0_as_uint8: bool = False,
    replace: Mapping[str, torch.Tensor | None] | None = None,
) -> dict[str, object]:
    """A ComfyUI mixed-precision file of ``state``: each weight of ``layers`` (weight key -> the layer's config,
    ``{"format": ...}``) quantized by :func:`comfy_quantize` and stored as ComfyUI saves a quantized layer (its
    ``QuantizedTensor.state_dict``: ``<layer>.weight``, ``<layer>.weight_scale``, ...), the others as they are.
    ``declare``: ``"markers"`` (a ``<layer>.comfy_quant`` tensor each, what ComfyUI's own save writes) or
    ``"metadata"`` (``_quantization_metadata``, what the converters write). ``input_scale``: an activation scale
    for the formats that have one; ``e8m0_as_uint8``: mxfp8's scales as uint8 bytes (ComfyUI reads both);
    ``replace``: tensors stored instead (None drops one). Returns weight key -> its quantized tensor."""
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, object] = {}
    declared: dict[str, object] = {}
    for key, value in state.items():
        if key not in layers:
            tensors[key] = value
            continue
        config = dict(layers[key])
        layer = key.removesuffix(".weight")
        qt = comfy_quantize(value, config)
        quantized[key] = qt
        for name, tensor in qt.state_dict(key).items():
            if e8m0_as_uint8 and tensor.dtype == getattr(torch, "float8_e8m0fnu", None):
                tensor = tensor.view(torch.uint8)
            tensors[name] = tensor.contiguous()
        if input_scale and config["format"] in WITH_INPUT_SCALE:
            tensors[f"{layer}.input_scale"] = torch.tensor(1.0)
        saved = {k: v for k, v in config.items() if k != "per_row"}
        if declare == "markers":
            tensors[f"{layer}.comfy_quant"] = comfy_quant_marker(saved)
        else:
            declared[layer] = saved
    for key, tensor in (replace or {}).items():
        if tensor is None:
            tensors.pop(key)
        else:
            tensors[key] = tensor
    metadata = None
    if declare == "metadata":
        metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": declared})}
    save_file(tensors, str(path), metadata=metadata)
    return quantized


def dequantized(qt: object) -> torch.Tensor:
    """comfy-kitchen's own dequantization of a quantized tensor (its eager backend), in float32."""
    from comfy_kitchen.registry import registry

    with registry.use_backend("eager"):
        return qt.dequantize()


def tensor_at(path: Path, stored) -> torch.Tensor:
    """A stored tensor's value (a reader's ``StoredTensor``) from the file's bytes, as core binds it: the byte range
    viewed as dtype and shape."""
    with open(path, "rb") as file:
        file.seek(stored.start)
        data = bytearray(file.read(stored.nbytes))
    return torch.frombuffer(data, dtype=stored.dtype).reshape(stored.shape)


def decode(path: Path, contents, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The encoded tensor ``key`` of a reader's ``FileContents`` of ``path``, decoded by its codec."""
    encoded = contents.encoded[key]
    parts = {name: tensor_at(path, contents.stored[stored]) for name, stored in encoded.parts.items()}
    return encoded.codec.unpack(parts, torch.Size(encoded.shape), dtype)
