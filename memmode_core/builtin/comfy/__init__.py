"""The built-in ``comfy`` reader: ComfyUI's safetensors files — the fp8 files of Comfy-Org's and Kijai's reposts
and the mixed-precision files of ComfyUI's quantization (NVFP4 and MXFP8 releases, int8, AWQ, "nvfp4mixed"
files whose layers are in several formats beside full-precision ones).

ComfyUI says how a file's weights are stored in one of three ways, all read here:

- **legacy "fp8 scaled"**: ``<layer>.weight`` in float8 (E4M3 or E5M2), a float32 ``<layer>.scale_weight`` of
  one element, a marker tensor ``scaled_fp8`` (its dtype names the float8 type), and ``<layer>.scale_input``;
- **quantization metadata** (ComfyUI's ``QUANTIZATION.md``): the header's ``__metadata__`` holds
  ``_quantization_metadata``, the JSON ``{"format_version": "1.0", "layers": {"<layer>": {"format": "nvfp4"},
  ...}}``, or each layer a ``<layer>.comfy_quant`` tensor (the JSON's bytes; what ComfyUI itself saves): each
  declared layer is stored in its format, the others at full precision;
- **plain fp8 casts**: float8 weights and no scale at all.

Three modules, one idea each: :mod:`~memmode_core.builtin.comfy.codecs` decodes each format's tensors (pure
torch, any device; the microscaling pieces are core's :mod:`memmode_core.quantization.microscaling`),
:mod:`~memmode_core.builtin.comfy.formats` says which tensors each format stores and checks them, and
:mod:`~memmode_core.builtin.comfy.reader` reads the header. A quantized layer's weight becomes an
:class:`~memmode_core.contracts.reader.EncodedTensor` of its format's codec, so that the layer *rests packed*
at the file's size, under every placement and storage, and decodes per forward on the compute device.
"""

from __future__ import annotations

from memmode_core.builtin.comfy.reader import ComfyReader
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.versions import KIT_VERSION

__all__ = ["ComfyReader"]

#: a built-in plugin is built for the kit of its own core
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_readers(register):
    register(ComfyReader())
