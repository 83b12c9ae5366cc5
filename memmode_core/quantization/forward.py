"""How a packed layer runs: its class becomes :class:`QuantizedLinear`, whose forward unpacks at call time.

The layer keeps its identity — placements computed their layout from module objects before quantization,
and hooks, adapters and references held elsewhere must keep working — and its class is changed to a cached
subclass of its own class, :class:`QuantizedLinear`, whose ``forward`` unpacks the weight from whatever the
layer's attributes hold *at call time*. That is what lets every placement and storage move quantized weights
without knowing about them (the engine swaps the tensors' ``.data``), keeps ``isinstance(layer, nn.Linear)``
true (peft finds the layer to wrap a LoRA around), and stays traceable by ``torch.compile`` after ``apply``.
A forward hook would have to mutate ``weight`` around each call, which neither FSDP nor compiled graphs
tolerate; swapping the module for another object would orphan the placement's layout. The class also
answers ``layer.weight`` with a memory-free stand-in (:mod:`memmode_core.engine.standins.quantized`).

The forward is installed apart from packing (:func:`install_forward`): a layer converted ahead for FSDP2,
or loaded packed from a file, holds packed tensors and no forward until a mode installs one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memmode_core.contracts.quantizer import Quantizer
from memmode_core.engine.standins.quantized import WeightStandInMixin
from memmode_core.quantization.packed import PACKED_ATTRIBUTE, PackedLayer, packed_record


class QuantizedLinear(WeightStandInMixin, nn.Linear):
    """An ``nn.Linear`` whose weight is packed; ``forward`` unpacks it from the current attributes.

    Layers become instances of this class (or of a cached subclass of their own class) by a class
    change, never by replacement. The matmul runs in the layer's compute dtype and the output comes
    back in the input's dtype, so a layer computing in bfloat16 drops into a float32 model; under
    autocast, the dtypes are autocast's business and nothing is cast here. ``weight`` reads as a
    stand-in (:attr:`WeightStandInMixin.weight <memmode_core.engine.standins.quantized.WeightStandInMixin.weight>`).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        record: PackedLayer = getattr(self, PACKED_ATTRIBUTE)
        dtype = record.compute_dtype
        weight = record.codec.unpack({name: getattr(self, name) for name in record.names}, record.shape, dtype)
        autocast = torch.is_autocast_enabled(input.device.type)
        x = input if autocast or input.dtype == dtype else input.to(dtype)
        bias = self.bias
        if bias is not None and not autocast and bias.dtype != dtype:
            bias = bias.to(dtype)
        output = F.linear(x, weight, bias)
        if not autocast and output.dtype != input.dtype:
            output = output.to(input.dtype)
        return output

    def _apply(self, fn, recurse=True):
        """``module.to(dtype)`` / ``.half()`` / ``.float()`` move a quantized layer's tensors but keep their dtypes.

        The packed codes and their scales must keep theirs (a float32 scale cast to bfloat16 silently
        changes every dequantized value; NVFP4's float8 block scales would be cast too), and the bias keeps
        its own as well: the layer computes in its compute dtype whatever its storage holds, and code that
        casts a layer before writing into its weight (VideoX-Fun's ``merge_lora``: ``layer.to(device,
        dtype)``, then ``layer.weight.data += ...``, written through by the stand-in) changes nothing but
        the codes the write re-quantizes. Devices change as asked. The cast copies made by ``fn`` are
        discarded (scales and biases: small).
        """
        originals = {
            name: (t.data if isinstance(t, nn.Parameter) else t)
            for name, t in (*self._parameters.items(), *self._buffers.items())
            if t is not None
        }
        result = super()._apply(fn, recurse)
        for name, original in originals.items():
            if name in self._parameters and self._parameters[name] is not None:
                current = self._parameters[name]
                if current.dtype != original.dtype:
                    current.data = original.to(device=current.device)
            elif name in self._buffers and self._buffers[name] is not None:
                current = self._buffers[name]
                if current.dtype != original.dtype:
                    self._buffers[name] = original.to(device=current.device)
        return result

    def extra_repr(self) -> str:
        record = packed_record(self)
        dtype = str(record.compute_dtype).replace("torch.", "")
        return f"{super().extra_repr()}, {record.format} -> {dtype}"


_SUBCLASSES: dict[type, type] = {nn.Linear: QuantizedLinear}


def quantized_class(cls: type) -> type:
    """The class a layer of class ``cls`` takes when its forward is installed (cached per class).

    It derives from ``cls`` as well, so ``isinstance`` checks against the layer's own class (FSDP2's
    ``FSDPLinear``, a library's ``nn.Linear`` subclass that does not override ``forward``) keep holding.
    """
    if issubclass(cls, QuantizedLinear):
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Quantized{cls.__name__}", (QuantizedLinear, cls), {"__module__": __name__})
        _SUBCLASSES[cls] = sub
    return sub


def install_forward(module: nn.Module, codec: Quantizer, compute_dtype: torch.dtype) -> None:
    """Make a packed layer run: it unpacks with ``codec`` and computes in ``compute_dtype``."""
    record = packed_record(module)
    if record is None:
        raise RuntimeError(f"{type(module).__name__} holds no packed weight")
    record.codec = codec
    record.compute_dtype = compute_dtype
    module.__class__ = quantized_class(type(module))
