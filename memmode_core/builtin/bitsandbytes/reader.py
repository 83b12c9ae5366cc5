"""The ``bitsandbytes`` reader's folder reading: each layer's JSON quant state parsed and checked, its parts found
and checked (dtype, element count, the nested absmax' values), the codec of its constants chosen
(:mod:`~memmode_core.builtin.bitsandbytes.codecs`)."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from memmode_core.builtin.bitsandbytes.codecs import BLOCKSIZES, INT8, LEVELS, Codecs, four_bit, levels
from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, QuantizedFolder, Reader, StoredTensor

QUANT_METHOD = "bitsandbytes"
#: a 4-bit layer's JSON state, ``<layer>.weight.quant_state.bitsandbytes__<nf4|fp4>``
STATE = ".quant_state.bitsandbytes__"
#: a layer's JSON state is a few hundred bytes; anything much longer is not one
MAX_STATE_BYTES = 1 << 16
#: the dtypes a 4-bit layer's weights were quantized from (``QuantState.dtype``, ``dequantize_4bit``'s check)
SOURCE_DTYPES = ("bfloat16", "float16", "float32")


class BitsAndBytesReader(Reader):
    """Reads folders diffusers saved from a model loaded with ``BitsAndBytesConfig`` (the format:
    :mod:`memmode_core.builtin.bitsandbytes`)."""

    name = "bitsandbytes"
    description = (
        "folders diffusers saved with BitsAndBytesConfig (NF4/FP4, double-quantized or not; LLM.int8()): "
        "the quantized weights rest packed, decoded per forward as bitsandbytes dequantizes them"
    )
    quant_methods = (QUANT_METHOD,)

    def codecs(self) -> Mapping[str, Quantizer]:
        return Codecs()

    def read_folder(self, folder: QuantizedFolder) -> FileContents:
        flags = _flags(folder)
        records = folder.stored
        states = [key for key in records if STATE in key]
        scbs = [key for key in records if key.endswith(".SCB")]
        if states and not flags["load_in_4bit"] or scbs and not flags["load_in_8bit"]:
            key = (states or scbs)[0]
            raise CheckpointError(
                f"{folder.where}: tensor {key!r} is a {'4' if states else '8'}-bit layer's, but the config's "
                f"quantization_config says load_in_4bit={flags['load_in_4bit']}, load_in_8bit={flags['load_in_8bit']}"
                f": the folder contradicts itself"
            )
        encoded: dict[str, EncodedTensor] = {}
        used: dict[str, StoredTensor] = {}  # the parts, as given back
        dropped: set[str] = set()
        for key in states:
            weight = key[: key.index(STATE)]
            encoded[weight], parts = _four_bit_layer(folder, weight, key)
            used.update(parts)
            dropped.update((key, f"{weight}.quant_map"))
        for key in scbs:
            layer = key.removesuffix(".SCB")
            encoded[f"{layer}.weight"], parts = _int8_layer(folder, layer)
            used.update(parts)
            dropped.add(f"{layer}.weight_format")
        for key in records:
            if key not in used and key not in dropped and _library_part(key):
                raise CheckpointError(
                    f"{folder.where}: tensor {key!r} is a part of a bitsandbytes layer whose weight or quant state "
                    f"is missing (a damaged folder)"
                )
        stored = {key: used.get(key, record) for key, record in records.items() if key not in dropped}
        kinds = Counter(getattr(tensor.codec, "kind", tensor.codec.format_name) for tensor in encoded.values())
        metadata = {"quant_method": QUANT_METHOD, "layers": ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))}
        return FileContents(stored, encoded, metadata=metadata)


def _flags(folder: QuantizedFolder) -> dict[str, bool]:
    config = folder.quantization_config
    flags = {}
    for flag in ("load_in_4bit", "load_in_8bit"):
        value = config.get(flag, config.get(f"_{flag}", False))
        if not isinstance(value, bool):
            raise CheckpointError(f"{folder.where}: quantization_config's {flag} is {value!r}, not true or false")
        flags[flag] = value
    if flags["load_in_4bit"] == flags["load_in_8bit"]:
        raise CheckpointError(
            f"{folder.where}: quantization_config sets load_in_4bit={flags['load_in_4bit']} and "
            f"load_in_8bit={flags['load_in_8bit']}; a bitsandbytes folder is one of the two"
        )
    return flags


def _library_part(key: str) -> bool:
    """Whether ``key`` names a tensor only a bitsandbytes layer has (its parts are checked with their layer)."""
    return key.endswith((".SCB", ".weight_format")) or any(
        key.endswith(f".weight.{part}") for part in ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
    )


# -- 4-bit layers ------------------------------------------------------------------------------------------------


def _state(folder: QuantizedFolder, key: str) -> dict[str, Any]:
    """A 4-bit layer's JSON state, every field checked as ``QuantState.from_dict`` and ``dequantize_4bit`` use it."""
    record = folder.stored[key]
    quant_type = key.rsplit("__", 1)[1]
    where = f"{folder.where}: tensor {key!r}"
    if quant_type not in LEVELS:
        raise CheckpointError(
            f"{where} is a bitsandbytes state of quant type {quant_type!r}; the bitsandbytes reader decodes "
            f"{' and '.join(LEVELS)} (as bitsandbytes does)"
        )
    if record.dtype != torch.uint8 or len(record.shape) != 1 or record.nbytes > MAX_STATE_BYTES:
        raise CheckpointError(f"{where} is not bitsandbytes' JSON quant state (uint8 bytes of a short JSON object)")
    try:
        state = json.loads(bytes(folder.read(key).numpy()))
        if not isinstance(state, dict):
            raise ValueError
        checked = {
            "quant_type": state["quant_type"],
            "blocksize": state["blocksize"],
            "dtype": state["dtype"],
            "shape": tuple(state["shape"]),
        }
        nested = {name: state[name] for name in ("nested_blocksize", "nested_dtype", "nested_offset") if name in state}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(
            f"{where} does not parse as bitsandbytes' quant state (the JSON of quant_type, blocksize, dtype and "
            f"shape): a damaged folder"
        ) from None
    problem = None
    if checked["quant_type"] != quant_type:
        problem = f"quant_type {checked['quant_type']!r} under a {quant_type} key"
    elif checked["blocksize"] not in BLOCKSIZES or isinstance(checked["blocksize"], bool):
        problem = f"blocksize {checked['blocksize']!r} (bitsandbytes' are {', '.join(map(str, BLOCKSIZES))})"
    elif checked["dtype"] not in SOURCE_DTYPES:
        problem = f"dtype {checked['dtype']!r} (bitsandbytes dequantizes {', '.join(SOURCE_DTYPES)})"
    elif len(checked["shape"]) != 2 or not all(isinstance(d, int) and d > 0 for d in checked["shape"]):
        problem = f"shape {list(checked['shape'])} (a linear layer's weight has two positive dimensions)"
    elif nested and len(nested) != 3:
        problem = f"only {sorted(nested)} of nested_blocksize, nested_dtype and nested_offset"
    elif nested and (not isinstance(nested["nested_blocksize"], int) or nested["nested_blocksize"] <= 0):
        problem = f"nested_blocksize {nested['nested_blocksize']!r}"
    elif nested and nested["nested_dtype"] != "float32":
        problem = f"nested_dtype {nested['nested_dtype']!r} (bitsandbytes' nested absmax decode in float32)"
    elif nested and (
        not isinstance(nested["nested_offset"], (int, float)) or not math.isfinite(nested["nested_offset"])
    ):
        problem = f"nested_offset {nested['nested_offset']!r} (not a finite number)"
    if problem is not None:
        raise CheckpointError(f"{where} is a bitsandbytes quant state with {problem}: a damaged folder")
    if nested:
        # QuantState.from_dict makes it a float32 tensor: the value added is the float32 nearest
        offset = struct.unpack("<f", struct.pack("<f", float(nested["nested_offset"])))[0]
        checked.update(nested_blocksize=nested["nested_blocksize"], nested_offset=offset)
    return checked


def _four_bit_layer(folder: QuantizedFolder, weight: str, key: str) -> tuple[EncodedTensor, dict[str, StoredTensor]]:
    state = _state(folder, key)
    shape, blocksize = state["shape"], state["blocksize"]
    count = math.prod(shape)
    blocks = -(-count // blocksize)
    nested = "nested_offset" in state
    codes = _part(folder, weight, key, weight, None, (count + 1) // 2)
    parts = {
        # the codes in any storage dtype (bnb_4bit_quant_storage) are the same bytes: given back as uint8
        PAYLOAD: StoredTensor(weight, torch.uint8, (codes.nbytes, 1), codes.start, codes.end),
        "weight_absmax": _part(
            folder, weight, key, f"{weight}.absmax", torch.uint8 if nested else torch.float32, blocks
        ),
    }
    if nested:
        nested_blocks = -(-blocks // state["nested_blocksize"])
        parts["weight_nested_absmax"] = _part(
            folder, weight, key, f"{weight}.nested_absmax", torch.float32, nested_blocks
        )
        parts["weight_nested_quant_map"] = _part(folder, weight, key, f"{weight}.nested_quant_map", torch.float32, 256)
        values = folder.read(parts["weight_nested_absmax"].key)
        if not torch.isfinite(values).all():
            raise CheckpointError(
                f"{folder.where}: tensor {parts['weight_nested_absmax'].key!r} holds values that are not finite: "
                f"the weights of {weight!r} are unknown"
            )
    quant_map = f"{weight}.quant_map"
    _part(folder, weight, key, quant_map, torch.float32, 16)
    if not torch.equal(folder.read(quant_map).reshape(-1), levels(state["quant_type"], torch.device("cpu"))):
        raise CheckpointError(
            f"{folder.where}: tensor {quant_map!r} is not bitsandbytes' {state['quant_type']} table, which its "
            f"state {key!r} names (bitsandbytes decodes with the table): the folder contradicts itself"
        )
    codec = four_bit(state["quant_type"], blocksize, state.get("nested_blocksize", 0), state.get("nested_offset", 0.0))
    keys = {name: part.key for name, part in parts.items()}
    return EncodedTensor(weight, shape, torch.float32, codec, keys), {part.key: part for part in parts.values()}


def _part(
    folder: QuantizedFolder, weight: str, state: str, key: str, dtype: torch.dtype | None, count: int
) -> StoredTensor:
    """The stored tensor ``key`` of ``weight``'s layer, checked: ``count`` elements of ``dtype`` (``None``: any
    dtype, ``count`` bytes)."""
    record = folder.stored.get(key)
    nbytes = record.nbytes if record is not None else 0
    numel = math.prod(record.shape) if record is not None else 0
    if record is not None and (nbytes == count if dtype is None else record.dtype == dtype and numel == count):
        return record
    needs = f"{count} bytes" if dtype is None else f"{count} {str(dtype).removeprefix('torch.')} values"
    has = "no such tensor" if record is None else f"{record.dtype} of shape {list(record.shape)}"
    raise CheckpointError(
        f"{folder.where}: tensor {key!r} must hold {needs} for {weight!r} as its state {state!r} declares it; "
        f"the folder has {has}"
    )


# -- 8-bit layers --------------------------------------------------------------------------------------------


def _int8_layer(folder: QuantizedFolder, layer: str) -> tuple[EncodedTensor, dict[str, StoredTensor]]:
    weight, scb = folder.stored.get(f"{layer}.weight"), folder.stored[f"{layer}.SCB"]
    if weight is None or weight.dtype != torch.int8 or len(weight.shape) != 2:
        has = "missing" if weight is None else f"{weight.dtype} of shape {list(weight.shape)}"
        raise CheckpointError(
            f"{folder.where}: tensor {layer + '.SCB'!r} scales an 8-bit weight {layer + '.weight'!r}, which is "
            f"{has}, not int8 [out, in]"
        )
    if scb.dtype != torch.float32 or scb.shape != weight.shape[:1]:
        raise CheckpointError(
            f"{folder.where}: tensor {scb.key!r} is {scb.dtype} of shape {list(scb.shape)}; the row scales of "
            f"{weight.key!r} {list(weight.shape)} are float32 [{weight.shape[0]}]"
        )
    if not torch.isfinite(folder.read(scb.key)).all():
        raise CheckpointError(f"{folder.where}: tensor {scb.key!r} holds scales that are not finite")
    layout = f"{layer}.weight_format"
    if layout in folder.stored:
        record = folder.stored[layout]
        value = folder.read(layout).reshape(-1).tolist() if record.dtype == torch.uint8 and record.nbytes == 1 else None
        if value != [0]:
            raise CheckpointError(
                f"{folder.where}: tensor {layout!r} is {value if value is not None else record.dtype}; bitsandbytes "
                f"reads only the row-major layout (0)"
            )
    keys = {PAYLOAD: weight.key, "weight_scb": scb.key}
    return EncodedTensor(weight.key, weight.shape, torch.float32, INT8, keys), {weight.key: weight, scb.key: scb}
