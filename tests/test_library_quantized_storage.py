"""Models another library quantized in memory — torchao (int8 weight-only), optimum-quanto (int8, int4, fp8) through
diffusers' ``from_pretrained(quantization_config=...)``, and diffusers' GGUF loader (``from_single_file`` of a file
gguf-py wrote) — under every offloading placement and every storage, ``disk`` and ``mmap`` included.

torchao's and quanto's weights are wrapper tensor subclasses, stored by their inner tensors and built again on
onload (:mod:`memmode_core.engine.flattened`); diffusers' ``GGUFParameter`` is a parameter class of plain bytes
that keeps its class and ``quant_type``. Each model is compared with itself not offloaded (bit-equal: the same
operands); the group files are opened and hold the inner tensors; ``mmap``'s resting inner tensors lie in the
mapped files; reads at rest get values; the planner prices the inner bytes the ledger counts; a subclass that cannot
be stored is refused, typed, before anything changes.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils._pytree import tree_map

import memmode_core as memmode
from community_pipelines import wan_inputs
from helpers import ACCELERATOR, assert_bit_equal, on_accelerator
from memmode_core.contracts.inner_tensors import SEPARATOR, flatten, is_wrapper, stored_bytes
from tiny_components import WAN_TRANSFORMER

pytest.importorskip("torchao")
pytest.importorskip("optimum.quanto")
gguf = pytest.importorskip("gguf")

from diffusers import GGUFQuantizationConfig, QuantoConfig, TorchAoConfig, WanTransformer3DModel  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from torchao.quantization import Int8WeightOnlyConfig  # noqa: E402

from gguf_files import write_gguf  # noqa: E402
from original_checkpoints import to_original, wan_plan  # noqa: E402

#: the offloading placements a single model runs under (``text_encoder_offload`` places a pipeline's encoders)
PLACEMENTS = [
    ("model_cpu_offload", {}),
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("sequential_cpu_offload", {}),
]
FORMATS = ["torchao-int8", "quanto-int8", "quanto-int4", "quanto-fp8", "gguf"]


@pytest.fixture(autouse=True)
def no_stand_in_escapes():
    """The suite's check (``conftest.py``), for the library's tensors as the library reads them: torchao implements
    no ``isfinite`` of its tensor, so each read of a resting weight here is its ``dequantize()``, which must be
    finite — never a placeholder's NaN."""
    from memmode_core.engine import watch

    before = {id(runtime) for runtime in watch.live_runtimes()}
    yield
    for runtime in watch.live_runtimes():
        if id(runtime) in before or runtime.removed:
            continue
        for component, module in runtime.components.items():
            for name, tensor in module.named_parameters():
                value = tensor.dequantize() if is_wrapper(tensor) else tensor
                if value.is_floating_point():
                    assert torch.isfinite(value).all(), f"{component}.{name} read as a non-finite value at rest"


@pytest.fixture(scope="module")
def folder() -> Path:
    """A tiny Wan transformer (every weight drawn from N(0, 0.05)) saved by diffusers, and the same weights as a GGUF
    file written the way city96's converter writes one (its matrices Q8_0 and Q4_0 in turn)."""
    where = Path(tempfile.mkdtemp(prefix="memmode-library-quantized-"))
    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN_TRANSFORMER).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    model.save_pretrained(where)
    state = model.state_dict()
    original = to_original(wan_plan(list(state)), state)
    types = (Q.Q8_0, Q.Q4_0)
    tensors = {key: (value.float().numpy(), types[i % 2]) for i, (key, value) in enumerate(original.items())}
    write_gguf(where / "transformer-q8_0-q4_0.gguf", tensors, arch="wan", keep_f32=(".modulation",))
    yield where
    for path in where.iterdir():
        path.unlink()
    where.rmdir()


def quantized(folder: Path, kind: str) -> torch.nn.Module:
    """The transformer as another library quantizes it in memory, the way a user asks diffusers for it.

    diffusers leaves the tensors it does not quantize as views of the checkpoint it read, at the offsets the file
    gives; a group file places every tensor at 64 bytes, as the CPU allocator does, and the CPU's kernels choose
    their path by the address: so those are copied into fresh memory, for the model to compute with the same
    operands offloaded or not (the quantized tensors are fresh already: the library made them)."""
    if kind == "gguf":
        config = GGUFQuantizationConfig(compute_dtype=torch.float32)
        path = folder / "transformer-q8_0-q4_0.gguf"
        model = WanTransformer3DModel.from_single_file(path, quantization_config=config, config=str(folder))
    else:
        configs = {
            "torchao-int8": lambda: TorchAoConfig(Int8WeightOnlyConfig()),
            "quanto-int8": lambda: QuantoConfig(weights_dtype="int8"),
            "quanto-int4": lambda: QuantoConfig(weights_dtype="int4"),
            "quanto-fp8": lambda: QuantoConfig(weights_dtype="float8"),
        }
        config = configs[kind]()
        model = WanTransformer3DModel.from_pretrained(folder, quantization_config=config, torch_dtype=torch.float32)
    for tensor in [*model.parameters(), *model.buffers()]:
        if not is_wrapper(tensor):
            tensor.data = tensor.data.clone()
    return model.eval()


def library_class(kind: str) -> str:
    return {"torchao-int8": "Int8Tensor", "quanto-int4": "WeightQBitsTensor", "gguf": "GGUFParameter"}.get(
        kind, "WeightQBytesTensor"
    )


def forward(model: torch.nn.Module, *, inference: bool = False) -> torch.Tensor:
    with torch.inference_mode() if inference else torch.no_grad():
        return model(**wan_inputs())[0]


def library_parameters(model: torch.nn.Module, kind: str) -> dict[str, torch.Tensor]:
    wanted = library_class(kind)
    found = {name: p for name, p in model.named_parameters() if any(c.__name__ == wanted for c in type(p).__mro__)}
    assert found, f"{kind}: no parameter of {wanted}"
    return found


@pytest.mark.parametrize("storage", ["ram", "disk", "mmap"])
@pytest.mark.parametrize("kind", FORMATS)
def test_every_placement_serves_the_library_quantized_model_exactly(folder, kind, storage):
    """Under each placement: two calls (the second in inference mode) bit-equal to the model not offloaded (the same
    operands), the library's
    classes kept (GGUF's ``quant_type`` too), the peak the planner predicted, priced at the inner tensors' bytes;
    after ``remove()`` the model is the library's again and computes the same."""
    model = quantized(folder, kind)
    reference = forward(model)
    kept = library_parameters(model, kind)
    classes = {name: type(p) for name, p in kept.items()}
    attributes = {name: getattr(p, "quant_type", None) for name, p in kept.items()}
    inner = sum(stored_bytes(t) for t in [*model.parameters(), *model.buffers()])
    assert kind == "gguf" or inner < sum(t.numel() * t.element_size() for t in model.parameters())
    entries = memmode.plan(model, device="cpu")
    for placement, options in PLACEMENTS:
        (planned,) = [
            e.peak_device_bytes
            for e in entries
            if e.storage == storage and e.mode == placement and all(e.options.get(k) == v for k, v in options.items())
        ]
        handle = memmode.apply(model, placement, storage=storage, device="cpu", **options)
        assert_bit_equal(forward(model), reference)
        # quanto's int4 forward fails in inference mode by itself ("Cannot set version_counter for inference tensor")
        assert_bit_equal(forward(model, inference=kind != "quanto-int4"), reference)
        report = handle.report()
        assert report.peak_device_bytes == planned <= inner, (placement, options)
        for name, parameter in library_parameters(model, kind).items():
            assert parameter is kept[name] and isinstance(parameter, classes[name])
            assert getattr(parameter, "quant_type", None) == attributes[name]
        handle.remove()
        assert all(type(kept[name]) is classes[name] for name in kept)
        assert_bit_equal(forward(model), reference)


@pytest.mark.parametrize("kind", ["torchao-int8", "quanto-int4", "gguf"])
def test_the_group_files_hold_the_inner_tensors(folder, kind, tmp_path):
    """Opened with safetensors, the ``disk`` group files hold each quantized weight by its inner tensors, named
    ``<weight>:<path>``, with their dtypes and bytes (a GGUF weight: its own bytes, under its own name)."""
    model = quantized(folder, kind)
    expected: dict[str, torch.Tensor] = {}
    for name, parameter in library_parameters(model, kind).items():
        if is_wrapper(parameter):
            _, leaves = flatten(parameter)
            expected.update({f"{name}{SEPARATOR}{path}": leaf.clone() for path, leaf in leaves.items()})
        else:
            expected[name] = parameter.detach().clone()
    handle = memmode.apply(model, "sequential_cpu_offload", storage="disk", device="cpu", offload_dir=tmp_path)
    stored: dict[str, torch.Tensor] = {}
    for path in tmp_path.glob("memmode-*.safetensors"):
        with safe_open(path, "pt") as file:
            stored.update({key: file.get_tensor(key) for key in file.keys()})
    assert set(expected) <= set(stored)
    for key, value in expected.items():
        assert stored[key].dtype == value.dtype and torch.equal(stored[key], value), key
    assert not any(name in stored for name, p in library_parameters(model, kind).items() if is_wrapper(p))
    handle.remove()


def mapped_ranges(folder: Path) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith(str(folder)):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads this process's mappings from /proc")
@pytest.mark.parametrize("kind", ["torchao-int8", "quanto-int4", "gguf"])
def test_mmap_maps_the_inner_tensors(folder, kind, tmp_path):
    """At rest under ``mmap`` every inner tensor of a quantized weight is a view of a mapped group file (no copy in
    the process's memory), and onloading on the CPU computes from those very pages."""
    model = quantized(folder, kind)
    handle = memmode.apply(model, "model_group_offload", storage="mmap", device="cpu", offload_dir=tmp_path)
    ranges = mapped_ranges(tmp_path)
    assert ranges
    for name, parameter in library_parameters(model, kind).items():
        tensors = flatten(parameter)[1].values() if is_wrapper(parameter) else [parameter]
        with torch._C.DisableTorchFunctionSubclass():
            pointers = [leaf.data_ptr() for leaf in tensors]
        del tensors  # no view of a mapping outlives the placement
        for pointer in pointers:
            assert any(start <= pointer < end for start, end in ranges), f"{name} is not a view of a mapped file"
    forward(model)
    handle.remove()
    assert mapped_ranges(tmp_path) == []


@pytest.mark.parametrize("storage", ["disk", "mmap"])
@pytest.mark.parametrize("kind", ["torchao-int8", "quanto-int4"])
def test_a_resting_weight_reads_as_its_value(folder, kind, storage):
    """A read of a quantized weight at rest — a torch function, the library's own ``dequantize()``, ``state_dict()``
    and saving it, ``copy.deepcopy`` — gets the weight's value (under ``disk``, from the file, counted), never the
    placeholder's NaN."""
    model = quantized(folder, kind)
    reference = forward(model)
    name, weight = next(iter(library_parameters(model, kind).items()))
    value = weight.dequantize().clone()
    layer = model.get_submodule(name.rpartition(".")[0])
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        linear = F.linear(x, weight, layer.bias).clone()
    handle = memmode.apply(model, "sequential_cpu_offload", storage=storage, device="cpu")
    forward(model)
    assert_bit_equal(weight.dequantize(), value)
    with torch.no_grad():
        assert_bit_equal(F.linear(x, weight, layer.bias), linear)
    state = model.state_dict()
    if storage == "disk":  # mmap's views of one file in several dtypes are refused by torch.save, plain ones alike
        torch.save({k: v for k, v in state.items() if k.startswith(name)}, Path(tempfile.mkdtemp()) / "weight.pt")
    assert_bit_equal(forward(copy.deepcopy(model)), reference)
    if storage == "disk":
        assert handle.report().reads_served > 0
    handle.remove()


@on_accelerator
@pytest.mark.parametrize("storage", ["pinned", "disk", "mmap"])
@pytest.mark.parametrize("kind", ["torchao-int8", "quanto-int4", "gguf"])
def test_on_an_accelerator_the_inner_tensors_are_copied_to_the_device(folder, kind, storage):
    """On an accelerator (CUDA, else the CPU under the strict model of asynchronous copies) the inner tensors are
    what is copied, on the engine's streams, and the library's tensor is built again over them on the device."""
    model = quantized(folder, kind)
    model.to(ACCELERATOR)  # the reference computes on the device, with the same kernels
    with torch.no_grad():
        inputs = {k: v.to(ACCELERATOR) if isinstance(v, torch.Tensor) else v for k, v in wan_inputs().items()}
        reference = model(**inputs)[0]
    model.to("cpu")
    handle = memmode.apply(model, "model_group_offload", storage=storage, device=ACCELERATOR, use_stream=True)
    for parameter in library_parameters(model, kind).values():
        assert parameter.device.type == "cpu"  # at rest
    assert_bit_equal(forward(model), reference)
    assert_bit_equal(forward(model), reference)
    handle.remove()


class Opaque(torch.Tensor):
    """A wrapper subclass without torch's flatten protocol: its values are in a Python attribute, nowhere memmode
    could read them as bytes."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Opaque) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_a_subclass_without_the_flatten_protocol_is_refused_before_anything_changes(storage):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    inner = model[0].weight.detach().clone()
    model[0]._parameters["weight"] = Opaque(inner)  # a Parameter of it cannot be made: its detach() is plain
    weight, bias = model[0].weight, model[1].weight.detach().clone()
    with pytest.raises(memmode.IncompatibleModeError, match="flatten protocol"):
        memmode.apply(model, "sequential_cpu_offload", storage=storage, device="cpu")
    assert model[0].weight is weight and type(weight) is Opaque and weight.inner is inner
    assert torch.equal(model[1].weight, bias) and type(model[1].weight) is torch.nn.Parameter
    assert memmode.remove(model) is False
