"""Layer 1, quantization mechanics: everything a quantizer does besides packing and unpacking one weight.

The ``Quantizer`` contract (``pack``, ``unpack``, ``skip_reason``) is in
:mod:`memmode_core.contracts.quantizer`; core does the rest, the same way for every format, in modules with
one job each (lowest first; each imports only those before it):

- ``packed``: a packed layer's state — the packed tensors in place of ``weight`` and the record that says how
  to read them (``PackedLayer``, ``packed_record``, ``is_quantized``, ``attach_packed``), and the refusal to
  fuse an adapter into packed weights (``refuse_fusing_packed``);
- ``sizes``: sizes of tensors and of packed tensors, learned from ``pack`` on meta tensors, and the check that
  a real ``pack`` keeps to them (``PackedSizes``, ``pack_checked``, ``component_bytes``);
- (what ``layer.weight`` reads as on a quantized layer, ``WeightStandIn``, is a stand-in like the others:
  :mod:`memmode_core.engine.standins.quantized`);
- ``forward``: the class a packed layer takes to run, whose forward unpacks at call time
  (``QuantizedLinear``, ``install_forward``);
- ``making``: the one stage where a packed layer is made and its forward installed (``make_packed``,
  ``make_placeholders`` for the layers a source of weights keeps packed, ``run_packed`` for layers packed
  before, ``compute_dtype_for``: the one rule for the dtype a packed layer computes in, ``PackedSpec``);
- ``selection``: which layers are packed, which are kept at full precision and why, and the sizes that leads
  to (``select_layers``, ``LayerSelection``);
- ``quantizing``: the checks, packing a component, converting ahead, the summary, and the entry points
  ``check`` and ``quantize`` that run a quantizer's override or these mechanics;
- ``saved``: the saved format (a quantized checkpoint's metadata);
- ``streaming``: packing one layer at a time into a file that is mapped back.

And two toolboxes that codecs of files decode with (readers' codecs import them; they import nothing of core):

- ``microscaling``: E2M1 codes two a byte, E8M0 exponents, scales per block of a row and cuBLAS' tiled block-scale
  layout — the shared decoding of ComfyUI's and ModelOpt's NVFP4 and MXFP8;
- ``row_bands``: decoding a large weight a band of rows at a time into the compute dtype
  (``decode_by_rows``), so a forward's decode never holds a whole layer in float32.

Callers import from this package. Beside the engine, above the contracts: it imports the engine's stand-ins
(``engine/standins/``), whose quantized stand-in reads the packed record (``packed``): no cycle, a test checks.
"""

from memmode_core.contracts.deprecation import moved_names
from memmode_core.contracts.quantizer import DEFAULT_EXCLUDE, OUTSIDE_BLOCKS, PAYLOAD
from memmode_core.engine.standins.quantized import WeightStandIn
from memmode_core.quantization.forward import QuantizedLinear, install_forward, quantized_class
from memmode_core.quantization.making import PackedSpec, compute_dtype_for, make_packed, make_placeholders, run_packed
from memmode_core.quantization.packed import (
    COMPUTE_DTYPES,
    PackedLayer,
    attach_packed,
    is_quantized,
    packed_record,
    refuse_fusing_packed,
)
from memmode_core.quantization.quantizing import (
    SIZES_ONLY,
    QuantizationSummary,
    check,
    check_component,
    check_components,
    check_weight_dtype,
    convert,
    overrides,
    quantize,
    quantize_component,
    summarize,
)
from memmode_core.quantization.selection import (
    LayerDecision,
    LayerSelection,
    decide_layers,
    quantized_direct_bytes,
    select_layers,
)
from memmode_core.quantization.sizes import PackedSizes, component_bytes, pack_checked, tensor_bytes

__all__ = [
    # entry points: a quantizer's override, or core's mechanics
    "check",
    "quantize",
    "overrides",
    # the mechanics
    "check_component",
    "check_components",
    "check_weight_dtype",
    "quantize_component",
    "convert",
    "summarize",
    "QuantizationSummary",
    "SIZES_ONLY",
    # which layers
    "select_layers",
    "decide_layers",
    "LayerSelection",
    "LayerDecision",
    "quantized_direct_bytes",
    # sizes
    "PackedSizes",
    "pack_checked",
    "component_bytes",
    "tensor_bytes",
    # the packed layer
    "PackedLayer",
    "packed_record",
    "is_quantized",
    "attach_packed",
    "refuse_fusing_packed",
    "QuantizedLinear",
    "quantized_class",
    "install_forward",
    # where a packed layer is made, and made to run
    "PackedSpec",
    "make_packed",
    "make_placeholders",
    "run_packed",
    "compute_dtype_for",
    "WeightStandIn",
    "COMPUTE_DTYPES",
    # the contract's vocabulary, re-exported for convenience (it lives in memmode_core.contracts.quantizer)
    "DEFAULT_EXCLUDE",
    "OUTSIDE_BLOCKS",
    "PAYLOAD",
]

#: names this package's ``__all__`` listed before, served under their new names (see contracts.deprecation)
__getattr__ = moved_names(__name__)
