"""The ``bitsandbytes`` reader: model folders diffusers saved from a model loaded with ``BitsAndBytesConfig``.

``save_pretrained`` of such a model writes ``"quantization_config": {"quant_method": "bitsandbytes",
"load_in_4bit": ..., "load_in_8bit": ..., ...}`` into the component's ``config.json`` and, beside the model's own
tensors, what bitsandbytes' layers put in their state dicts:

- **4-bit** (``Linear4bit``: NF4 or FP4, ``QuantState.as_dict(packed=True)`` under ``<layer>.weight.``):
  ``<layer>.weight`` the codes, two a byte, the first in the high nibble (``uint8`` ``[(n + 1) // 2, 1]``, or the
  same bytes in the ``bnb_4bit_quant_storage`` dtype); ``.absmax`` one ``float32`` per block of ``blocksize``
  values of the flattened weight; ``.quant_map`` the 16 levels; ``.quant_state.bitsandbytes__<nf4|fp4>`` the JSON
  bytes of ``{"quant_type", "blocksize", "dtype", "shape"}``. With double quantization (``compress_statistics``)
  ``.absmax`` is ``uint8``: the absmax less their mean, quantized blockwise (256 a block) with bitsandbytes'
  8-bit dynamic map, whose levels are ``.nested_quant_map`` and whose block maxima are ``.nested_absmax``; the
  JSON adds ``nested_blocksize``, ``nested_dtype`` and ``nested_offset`` (the mean, a float);
- **8-bit** (``Linear8bitLt``, LLM.int8()): ``<layer>.weight`` ``int8`` ``[out, in]``, ``<layer>.SCB`` the
  ``float32`` absmax of each row, ``<layer>.weight_format`` a ``uint8`` 0 ("row", the only layout bitsandbytes
  still reads).

Each quantized weight becomes an :class:`EncodedTensor` whose parts are the folder's own tensors, decoded by the
forward exactly as bitsandbytes dequantizes (``dequantize_4bit``, ``int8_vectorwise_dequant``), in float32 and
rounded once to the compute dtype, in pure torch: no bitsandbytes at run time. bitsandbytes decodes a 4-bit
weight with the fixed table of its quant type (the stored ``quant_map`` is not read by its kernels), so the table
is the codec's and the stored map is only checked against it; the nested map is the file's, as bitsandbytes
uses it. The block size, the quant type and a double-quantized layer's offset are not tensors, so they are the
codec's: one codec per distinct set (:func:`four_bit`), each with its own format name, which
:meth:`BitsAndBytesReader.codecs` parses back for ``save_quantized``'s files. (An 8-bit layer is decoded as
diffusers' ``dequantize_bnb_weight`` does; LLM.int8()'s own matmul, which quantizes activations and keeps
outlier columns in float16, is not reproduced: memmode computes with the dequantized weight.)

The JSON states, the stored ``quant_map`` and ``weight_format`` are read (a few hundred bytes a layer) and checked,
with every part's dtype and element count and the nested absmax' values; the codes and the absmax are not read.
Anything else — an unknown quant type, a state that does not parse, a part of the wrong shape, a layer the
config's flags do not announce — is a :class:`CheckpointError` naming the folder and the tensor.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, QuantizedFolder, Reader, StoredTensor
from memmode_core.contracts.versions import KIT_VERSION
from memmode_core.quantization.row_bands import decode_by_rows

QUANT_METHOD = "bitsandbytes"
#: the levels of each 4-bit quant type, as bitsandbytes' ``get_4bit_type`` lists them (code order); it divides
#: them by their largest magnitude in float32, which :func:`levels` repeats
LEVELS = {
    "nf4": (
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ),
    "fp4": (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0),
}  # fmt: skip
#: the block sizes ``quantize_4bit`` accepts
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: the dtypes a 4-bit layer's weights were quantized from (``QuantState.dtype``, ``dequantize_4bit``'s check)
SOURCE_DTYPES = ("bfloat16", "float16", "float32")
STATE = ".quant_state.bitsandbytes__"
#: a layer's JSON state is a few hundred bytes; anything much longer is not one
MAX_STATE_BYTES = 1 << 16
#: what ``int8_vectorwise_dequant`` multiplies by: the float32 nearest 1 / 127, written as bitsandbytes does
INV_127 = 7.874015718698502e-3


#: each quant type's levels as float32 on each device they were asked on: made once per device, not copied from
#: the host at every call (never derived from a layer's tensors)
_LEVELS: dict[tuple[str, torch.device], torch.Tensor] = {}
_PAIRS: dict[tuple[str, torch.device], torch.Tensor] = {}


def levels(quant_type: str, device: torch.device) -> torch.Tensor:
    """The 16 float32 levels of ``quant_type`` on ``device``: bitsandbytes' table, divided by its largest
    magnitude in float32 as ``get_4bit_type`` does."""
    table = _LEVELS.get((quant_type, device))
    if table is None:
        table = torch.tensor(LEVELS[quant_type], dtype=torch.float32)
        table = _LEVELS[quant_type, device] = table.div_(table.abs().max()).to(device)
    return table


def level_pairs(quant_type: str, device: torch.device) -> torch.Tensor:
    """The two levels each of the 256 bytes holds (the high nibble's first: bitsandbytes' order), a pair of float32
    as one int64: one gather a byte gives both values (as core's ``e2m1_to_float`` looks E2M1 pairs up)."""
    table = _PAIRS.get((quant_type, device))
    if table is None:
        single, byte = levels(quant_type, torch.device("cpu")), torch.arange(256)
        pairs = torch.stack((single[byte >> 4], single[byte & 15]), dim=1).contiguous()
        table = _PAIRS[quant_type, device] = pairs.view(torch.int64).reshape(256).to(device)
    return table


def blockwise(values: torch.Tensor, scales: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Each of ``values`` (float32, flat) times the scale of its block of ``blocksize``, in float32, the last block
    possibly short (bitsandbytes' ``_dequantize_blockwise_compute`` and ``_dequantize_4bit_compute``)."""
    count = values.numel()
    full = count // blocksize * blocksize
    out = torch.empty_like(values)
    torch.mul(
        values[:full].view(-1, blocksize), scales[: full // blocksize].view(-1, 1), out=out[:full].view(-1, blocksize)
    )
    if full < count:
        torch.mul(values[full:], scales[full // blocksize], out=out[full:])
    return out


class BnbFourBit(Quantizer):
    """bitsandbytes' NF4 or FP4 weights: ``weight_packed`` the codes (``uint8``, two a byte, high nibble first),
    ``weight_absmax`` the block maxima (``float32``; with double quantization ``uint8`` codes, decoded with
    ``weight_nested_absmax`` and ``weight_nested_quant_map`` and the codec's offset). Decoded in float32 as
    ``dequantize_4bit`` computes — ``level[code] * absmax[block]`` — and rounded once to the compute dtype."""

    packs = False

    def __init__(self, quant_type: str, blocksize: int, nested_blocksize: int = 0, nested_offset: float = 0.0) -> None:
        self.quant_type, self.blocksize = quant_type, blocksize
        self.nested_blocksize, self.nested_offset = nested_blocksize, nested_offset
        self.name = self.format = format_name(quant_type, blocksize, nested_blocksize, nested_offset)
        #: what the layers are, for the folder's summary (the offset is each layer's own)
        self.kind = f"{quant_type} (blocks of {blocksize}{', double-quantized' if nested_blocksize else ''})"
        nested = f", double-quantized ({nested_blocksize} a block)" if nested_blocksize else ""
        self.description = (
            f"bitsandbytes {quant_type.upper()} weights, blocks of {blocksize}{nested} (read from folders)"
        )

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            f"{self.name} decodes weights bitsandbytes quantized (a folder diffusers saved); it does not quantize "
            f"weights (load the folder with memmode.load, or quantize with qfloat8 or qfloat4)"
        )

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The weight, a band of rows at a time (:func:`~memmode_core.quantization.row_bands.decode_by_rows`): a
        large layer's float32 values are never all alive beside the result."""
        codes = packed[PAYLOAD].reshape(-1)
        blocksize, per_row = self.blocksize, math.prod(shape[1:])
        absmax = packed["weight_absmax"].reshape(-1)
        if self.nested_blocksize:
            # dequantize_blockwise of the absmax codes (float32), then the offset added in float32
            nested = packed["weight_nested_quant_map"].index_select(0, absmax.int())
            absmax = blockwise(nested, packed["weight_nested_absmax"].reshape(-1), self.nested_blocksize)
            absmax = absmax + self.nested_offset
        pairs = level_pairs(self.quant_type, codes.device)

        def decode(rows: slice) -> torch.Tensor:
            start, stop = rows.start * per_row, rows.stop * per_row
            # the blocks run over the flattened weight: decoded from the start of the block the band begins in
            first = start - start % blocksize
            # each byte's two values at once; an odd count leaves the last byte's second value unused
            values = pairs.index_select(0, codes[first // 2 : (stop + 1) // 2].int()).view(torch.float32)
            scaled = blockwise(values[: stop - first], absmax[first // blocksize : -(-stop // blocksize)], blocksize)
            return scaled[start - first :]

        return decode_by_rows(shape, dtype, decode)


class BnbInt8(Quantizer):
    """bitsandbytes' LLM.int8() weights: ``weight_packed`` the ``int8`` codes, ``weight_scb`` the absmax of each
    row; decoded in float32 as ``int8_vectorwise_dequant`` computes (``codes * scb * (1/127)``, in that order)
    and rounded once to the compute dtype."""

    packs = False
    name = format = "bnb_int8"
    description = "bitsandbytes LLM.int8() weights: int8 rows with a float32 absmax each (read from folders)"

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            f"{self.name} decodes weights bitsandbytes quantized (a folder diffusers saved); it does not quantize "
            f"weights (load the folder with memmode.load, or quantize with qfloat8 or qfloat4)"
        )

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        codes = packed[PAYLOAD].reshape(shape[0], -1)
        scb = packed["weight_scb"].to(torch.float32).reshape(-1, 1)

        def decode(rows: slice) -> torch.Tensor:
            return codes[rows].to(torch.float32) * scb[rows] * INV_127

        return decode_by_rows(shape, dtype, decode)


INT8 = BnbInt8()


def format_name(quant_type: str, blocksize: int, nested_blocksize: int = 0, nested_offset: float = 0.0) -> str:
    """``bnb_nf4_b64``; double-quantized ``bnb_nf4_b64_n256_o3db25000`` (the offset's float32 bits, in hex)."""
    name = f"bnb_{quant_type}_b{blocksize}"
    if nested_blocksize:
        name += f"_n{nested_blocksize}_o{struct.unpack('<I', struct.pack('<f', nested_offset))[0]:08x}"
    return name


FORMAT = re.compile(r"bnb_(nf4|fp4)_b(\d+)(?:_n(\d+)_o([0-9a-f]{8}))?")


@functools.cache
def four_bit(quant_type: str, blocksize: int, nested_blocksize: int = 0, nested_offset: float = 0.0) -> BnbFourBit:
    """The codec of one constant set, shared by every layer and folder that has it."""
    return BnbFourBit(quant_type, blocksize, nested_blocksize, nested_offset)


class Codecs(Mapping[str, Quantizer]):
    """Every codec of this reader by format name: the 8-bit one and the 4-bit ones of each quant type and block
    size are listed; a double-quantized one (its offset in its name) is made from its name when asked for."""

    def __getitem__(self, name: str) -> Quantizer:
        if name == INT8.format_name:
            return INT8
        found = FORMAT.fullmatch(name)
        if found is None or int(found[2]) not in BLOCKSIZES:
            raise KeyError(name)
        quant_type, blocksize, nested, offset = found.groups()
        if nested is None:
            return four_bit(quant_type, int(blocksize))
        value = struct.unpack("<f", struct.pack("<I", int(offset, 16)))[0]
        if int(nested) <= 0 or not math.isfinite(value):
            raise KeyError(name)
        return four_bit(quant_type, int(blocksize), int(nested), value)

    def __iter__(self) -> Iterator[str]:
        yield INT8.format_name
        for quant_type in LEVELS:
            for blocksize in BLOCKSIZES:
                yield format_name(quant_type, blocksize)

    def __len__(self) -> int:
        return 1 + len(LEVELS) * len(BLOCKSIZES)


class BitsAndBytesReader(Reader):
    """Reads folders diffusers saved from a model loaded with ``BitsAndBytesConfig`` (see the module's docstring)."""

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


#: a built-in plugin is built for the kit of its own core
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_readers(register):
    register(BitsAndBytesReader())
