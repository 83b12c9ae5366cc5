"""Which layers of a component a quantizer packs, which it keeps at full precision, and why.

Decided once, from module classes, names and shapes, without touching any weight — so that the checks, the
planner's size predictions, the storages' reservations and the real quantization all follow the same
decisions (:class:`LayerSelection`), and the report can say why each kept layer was kept.

Every ``nn.Linear`` of a component whose class does not override ``forward`` is a candidate, minus, in this
order: the modules the model itself declares precision-sensitive (``_keep_in_fp32_modules``, honoured as
diffusers' own quantizers honour it), the default exclusions, the user's ``exclude=`` fragments (a fragment
excludes every layer whose qualified name contains it), and the shapes the format cannot hold
(``Quantizer.skip_reason``, e.g. NVFP4 needs an input width that is a multiple of 16). Each layer left at full
precision is reported with its reason.

The default exclusions (:data:`~memmode_core.contracts.quantizer.DEFAULT_EXCLUDE`) are the layers *outside
the repeated blocks* of a transformer — the stem that embeds the timestep, the text and the latent patches,
and the head that produces the prediction: 1.5% of the bytes and three quarters of the error (measured in
docs/quantizers.md, "Default exclusions, measured"). ``exclude=`` adds fragments; the quantizer option
``default_exclude=()`` quantizes the stem and head too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch import nn

from memmode_core.contracts.quantizer import DEFAULT_EXCLUDE, OUTSIDE_BLOCKS, Quantizer
from memmode_core.quantization.packed import COMPUTE_DTYPES, packed_record
from memmode_core.quantization.sizes import PackedSizes, direct_bytes, direct_tensors, tensor_bytes


@dataclass
class LayerDecision:
    """The decision for one ``nn.Linear``."""

    path: str
    module: nn.Module
    #: "pack" (to be packed), "packed" (packed already, in ``format``) or "keep" (full precision)
    action: str
    #: why the layer stays at full precision ("keep")
    reason: str | None = None
    #: the format of an already packed layer ("packed")
    format: str | None = None


def _block_paths(component: nn.Module) -> list[str]:
    """Paths of the repeated blocks.

    The classes a diffusers or transformers model declares as its blocks (``_repeated_blocks``,
    ``_no_split_modules``); for a model that declares none, the children of any ``ModuleList`` /
    ``Sequential`` holding at least two modules of one class.
    """
    declared = set(getattr(component, "_repeated_blocks", None) or ())
    declared |= set(getattr(component, "_no_split_modules", None) or ())
    if declared:
        # by the class or a base of it: FSDP2 wraps a sharded block's class in a subclass of its own
        paths = [
            path
            for path, module in component.named_modules()
            if path and any(cls.__name__ in declared for cls in type(module).__mro__)
        ]
        if paths:
            return paths
    paths = []
    for path, module in component.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            classes = [type(child) for _, child in children]
            if any(classes.count(c) >= 2 for c in set(classes)):
                paths += [f"{path}.{name}" if path else name for name, _ in children]
    return paths


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + ".") for root in roots)


def _unpackable_reason(module: nn.Module) -> str | None:
    """Why an ``nn.Linear`` cannot be packed in any format; None when it can."""
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has its own forward"
    weight = module.weight
    if weight is None or weight.dim() != 2:
        return "it has no 2-D weight"
    if weight.dtype not in COMPUTE_DTYPES:
        return f"its weight is {weight.dtype}, not a full-precision float"
    return None


def decide_layers(
    quantizer: Quantizer,
    component: nn.Module,
    *,
    exclude: Iterable[str] = (),
    default_exclude: Iterable[str] = DEFAULT_EXCLUDE,
) -> list[LayerDecision]:
    """The decision for each ``nn.Linear`` of ``component``, in the order of the module docstring."""
    exclude = tuple(exclude)
    default_exclude = tuple(default_exclude)
    keep_fp32 = tuple(getattr(component, "_keep_in_fp32_modules", None) or ())
    fragments = tuple(f for f in default_exclude if f != OUTSIDE_BLOCKS)
    blocks = _block_paths(component) if OUTSIDE_BLOCKS in default_exclude else []
    decisions: list[LayerDecision] = []
    for path, module in component.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        record = packed_record(module)
        if record is not None:
            decisions.append(LayerDecision(path, module, "packed", format=record.format))
            continue
        segments = path.split(".")
        reason = _unpackable_reason(module)
        if reason is None and (name := next((n for n in keep_fp32 if n in segments), None)):
            reason = f"kept in float32 by the model (_keep_in_fp32_modules: {name!r})"
        if reason is None and blocks and not _inside(path, blocks):
            reason = "outside the repeated blocks (default exclusion)"
        if reason is None and (name := next((f for f in fragments if f in path), None)):
            reason = f"default exclusion {name!r}"
        if reason is None and (name := next((f for f in exclude if f in path), None)):
            reason = f"exclude={name!r}"
        if reason is None:
            reason = quantizer.skip_reason(module.weight.shape)
        decisions.append(LayerDecision(path, module, "keep" if reason else "pack", reason))
    return decisions


@dataclass
class LayerSelection:
    """Every decision quantizing one component makes, computed from shapes without touching it."""

    quantizer: Quantizer
    component: nn.Module
    layers: list[LayerDecision]
    sizes: PackedSizes
    _by_module: dict[int, LayerDecision] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_module = {id(p.module): p for p in self.layers}

    @property
    def to_pack(self) -> list[LayerDecision]:
        return [p for p in self.layers if p.action == "pack"]

    @property
    def packed(self) -> list[LayerDecision]:
        return [p for p in self.layers if p.action == "packed"]

    @property
    def kept(self) -> list[LayerDecision]:
        return [p for p in self.layers if p.action == "keep"]

    @property
    def packs_anything(self) -> bool:
        """False when the component is packed already: quantizing it again is a no-op."""
        return not self.packed

    def direct_bytes(self, module: nn.Module) -> int:
        """Bytes of ``module``'s own parameters and buffers once the component is quantized."""
        decision = self._by_module.get(id(module))
        if (
            decision is None
            or decision.action != "pack"
            or not self.packs_anything
            or packed_record(module) is not None
        ):
            return direct_bytes(module)  # not to be packed, or packed since the selection was made
        rest = tensor_bytes(t for name, t in direct_tensors(module) if name != "weight")
        return rest + self.sizes.nbytes(module.weight.shape, module.weight.dtype)

    def total_bytes(self) -> int:
        """Bytes of the component's tensors once quantized (the sum of every module's ``direct_bytes``;
        a tensor tied between two modules counts for each)."""
        return sum(self.direct_bytes(m) for m in self.component.modules())


def select_layers(
    quantizer: Quantizer,
    component: nn.Module,
    *,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
) -> LayerSelection:
    """Which layers of ``component`` quantizing packs, which it keeps and why, and the sizes that
    leads to. :func:`memmode_core.quantization.quantize_component` follows exactly this selection."""
    default_exclude = tuple((options or {}).get("default_exclude", DEFAULT_EXCLUDE))
    layers = decide_layers(quantizer, component, exclude=exclude, default_exclude=default_exclude)
    return LayerSelection(quantizer, component, layers, PackedSizes(quantizer))


def quantized_direct_bytes(
    quantizer: Quantizer,
    module: nn.Module,
    *,
    exclude: Iterable[str] = (),
    component: nn.Module | None = None,
    options: Mapping[str, object] | None = None,
) -> int:
    """Bytes of ``module``'s own tensors (not its children's) after quantization, without quantizing.

    ``component`` is the quantizer's target that contains ``module`` (default: ``module`` itself):
    exclusions are decided in its context, as ``apply`` decides them. To size many modules of one
    component, call :func:`select_layers` once and ask its ``direct_bytes``.
    """
    selection = select_layers(
        quantizer, component if component is not None else module, exclude=exclude, options=options
    )
    return selection.direct_bytes(module)
