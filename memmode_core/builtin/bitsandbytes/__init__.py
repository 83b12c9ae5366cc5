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

Two modules, one idea each: :mod:`~memmode_core.builtin.bitsandbytes.codecs` decodes a layer's tensors (the levels,
the blocks, one codec per constant set and the names that find them again) and
:mod:`~memmode_core.builtin.bitsandbytes.reader` reads a folder's states and checks its parts.
"""

from __future__ import annotations

from memmode_core.builtin.bitsandbytes.reader import BitsAndBytesReader
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.versions import KIT_VERSION

__all__ = ["BitsAndBytesReader"]

#: a built-in plugin is built for the kit of its own core
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_readers(register):
    register(BitsAndBytesReader())
