"""Model and pipeline folders that diffusers' own ``save_pretrained`` writes for models quantized by bitsandbytes and
optimum-quanto, made on the CPU from the suite's tiny models, and each quantized weight as the library itself
dequantizes it: the fixtures and the anchors of the ``bitsandbytes`` and ``quanto`` readers' tests.

The model is the 256-wide Wan transformer of the community-file tests (``community_pipelines.WIDE_WAN``, every weight
drawn from N(0, 0.05)), saved plain, then loaded with ``from_pretrained(quantization_config=..., torch_dtype=...)``
— diffusers' quantizer replaces the linear layers and quantizes them as it loads, keeping Wan's float32 modules — and
saved again with ``save_pretrained``: a model folder per method in bfloat16 (:func:`model_folder`), and the Wan 2.2
pipeline's folder with only its ``transformer`` quantized, in float32 (:func:`pipeline_folder`). Its layers cover
what the formats do with shapes: 256 inputs (several bitsandbytes blocks of 64 a row, quanto's groups of 128), 32
inputs (a row shorter than a bitsandbytes block; quanto does not group it), 1024 blocks of absmax in a layer (four
nested blocks of 256).

- bitsandbytes 0.50 quantizes on the CPU, but diffusers' quantizer refuses to start without an accelerator
  (``validate_environment``: "No GPU found"); :func:`bitsandbytes_on_cpu` lets only that check see one, and
  everything else — the layer replacement, ``Params4bit`` / ``Int8Params`` quantizing, the state dict — is
  diffusers' and bitsandbytes' own code on the CPU;
- optimum-quanto quantizes on the CPU as it is.

The anchors (:func:`anchor_weights`): bitsandbytes' ``QuantState.from_dict`` and ``dequantize_4bit`` in float32 (and
its device-independent implementation, the default backend's, which its CPU kernel disagrees with on rows shorter
than a block — see ``anchor_weights``), ``int8_vectorwise_dequant``; quanto's own deserialization
(``WeightQBytesTensor`` / ``WeightQBitsTensor.load_from_state_dict``) and ``dequantize``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
import transformers
from diffusers import BitsAndBytesConfig, QuantoConfig, WanTransformer3DModel
from safetensors import safe_open

from community_pipelines import wide_wan_pipeline

#: every method a folder is made with, by the name the tests give it: how diffusers is asked to quantize
METHODS: dict[str, Callable[[], object]] = {
    "bnb_nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bnb_nf4_double": lambda: BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    ),
    "bnb_fp4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "bnb_fp4_double": lambda: BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True
    ),
    # the codes stored in another dtype (for FSDP): the same bytes
    "bnb_nf4_bf16_storage": lambda: BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16
    ),
    "bnb_int8": lambda: BitsAndBytesConfig(load_in_8bit=True),
    "quanto_int8": lambda: QuantoConfig(weights_dtype="int8"),
    "quanto_float8": lambda: QuantoConfig(weights_dtype="float8"),
    "quanto_int4": lambda: QuantoConfig(weights_dtype="int4"),
    "quanto_int2": lambda: QuantoConfig(weights_dtype="int2"),
}
#: the dtype a model folder is quantized in (``from_pretrained(torch_dtype=...)``: Wan's float32 modules stay
#: float32; quanto's scales keep the model's dtype); a pipeline folder is quantized in float32, the pipeline's own
DTYPE = torch.bfloat16
WEIGHTS = "diffusion_pytorch_model.safetensors"
#: a transformers model's checkpoint
TRANSFORMERS_WEIGHTS = "model.safetensors"
#: the methods a transformers component (the pipeline's UMT5 text encoder) is quantized with, by transformers' own
#: ``BitsAndBytesConfig`` (its quantizer runs on the CPU as it is); transformers cannot save a quanto model
TEXT_ENCODER_METHODS: dict[str, Callable[[], object]] = {
    "bnb_int8": lambda: transformers.BitsAndBytesConfig(load_in_8bit=True),
    "bnb_nf4_double": lambda: transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    ),
}


def _folder(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


@contextlib.contextmanager
def bitsandbytes_on_cpu() -> Iterator[None]:
    """diffusers' bitsandbytes quantizers started on a machine without an accelerator: only their environment check
    sees one (bitsandbytes quantizes on the CPU; diffusers checks for a GPU before it starts)."""
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    def lifted(check):
        @functools.wraps(check)
        def validate_environment(self, *args, **kwargs):
            with mock.patch.object(torch.cuda, "is_available", lambda: True):
                return check(self, *args, **kwargs)

        return validate_environment

    with contextlib.ExitStack() as stack:
        for cls in (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer):
            stack.enter_context(mock.patch.object(cls, "validate_environment", lifted(cls.validate_environment)))
        yield


@functools.cache
def plain_model() -> Path:
    """The 256-wide Wan transformer (one of the pipeline's two), saved plain (float32)."""
    folder = _folder("memmode-library-plain-")
    wide_wan_pipeline().transformer.save_pretrained(folder)
    return folder


def quantize_folder(source: Path, target: Path, method: str, dtype: torch.dtype, **save: object) -> Path:
    """``save_pretrained(**save)`` into ``target`` of the model of ``source`` loaded in ``dtype`` with ``method``'s
    config."""
    config = METHODS[method]()
    device = {"device_map": "cpu"} if method.startswith("bnb") else {}
    with bitsandbytes_on_cpu() if method.startswith("bnb") else contextlib.nullcontext():
        model = WanTransformer3DModel.from_pretrained(source, quantization_config=config, torch_dtype=dtype, **device)
    model.save_pretrained(target, **save)
    return target


@functools.cache
def model_folder(method: str) -> Path:
    """The transformer's folder as diffusers saves it quantized with ``method`` (made once a session)."""
    return quantize_folder(plain_model(), _folder(f"memmode-{method}-"), method, DTYPE)


@functools.cache
def sharded_model_folder(method: str) -> Path:
    """:func:`model_folder` saved in shards of 300 kB (diffusers' index beside them: a layer's codes, absmax and
    quant state may lie in different files)."""
    return quantize_folder(plain_model(), _folder(f"memmode-{method}-sharded-"), method, DTYPE, max_shard_size="300KB")


@functools.cache
def pipeline_folder(method: str) -> Path:
    """The Wan 2.2 pipeline's folder with only its ``transformer`` quantized with ``method`` (``transformer_2``, the
    text encoder and the VAE as saved plain), all in float32: made once a session."""
    folder = _folder(f"memmode-{method}-pipeline-")
    wide_wan_pipeline().save_pretrained(folder)
    quantized = quantize_folder(folder / "transformer", _folder(f"memmode-{method}-tf-"), method, torch.float32)
    shutil.rmtree(folder / "transformer")
    shutil.copytree(quantized, folder / "transformer")
    return folder


@functools.cache
def text_encoder_folder(method: str) -> Path:
    """The Wan 2.2 pipeline's folder with only its text encoder (UMT5) quantized with ``method`` by transformers'
    ``from_pretrained`` and saved by its ``save_pretrained``, in float32: made once a session."""
    folder = _folder(f"memmode-{method}-text-encoder-pipeline-")
    wide_wan_pipeline().save_pretrained(folder)
    model = transformers.UMT5EncoderModel.from_pretrained(
        folder / "text_encoder",
        quantization_config=TEXT_ENCODER_METHODS[method](),
        dtype=torch.float32,
        device_map="cpu",
    )
    shutil.rmtree(folder / "text_encoder")
    model.save_pretrained(folder / "text_encoder")
    return folder


def checkpoint(folder: Path) -> Path:
    """A model folder's one-file checkpoint: diffusers' or transformers' name."""
    return folder / WEIGHTS if (folder / WEIGHTS).is_file() else folder / TRANSFORMERS_WEIGHTS


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's (one-file) checkpoint."""
    with safe_open(checkpoint(folder), "pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}


def quantization_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def quantized_weights(folder: Path) -> list[str]:
    """The keys (``<layer>.weight``) of the weights the library quantized in a model folder."""
    keys = tensors(folder).keys()
    found = {key.split(".weight.")[0] + ".weight" for key in keys if ".weight." in key}  # bnb 4-bit, quanto
    found |= {key.removesuffix(".SCB") + ".weight" for key in keys if key.endswith(".SCB")}  # bnb 8-bit
    return sorted(found)


# -- the anchors: each weight as the library dequantizes it ----------------------------------------------------------


def anchor_weights(folder: Path, default_backend: bool = False) -> dict[str, torch.Tensor]:
    """Each quantized weight of a model folder as its library dequantizes it, by weight key.

    bitsandbytes: 4-bit weights by ``dequantize_4bit`` of ``QuantState.from_dict`` in float32 (bitsandbytes
    computes in float32 and rounds once); with ``default_backend``, by the default backend's
    ``_dequantize_4bit_compute`` (eager) — what bitsandbytes computes on every device but the CPU, and what its
    quantization means: 0.50.2's CPU kernel (``cdequantize_blockwise_cpu_*``) decodes a weight whose rows are shorter
    than a block as if the blocks were cut at each row, so it disagrees on such layers. 8-bit weights by
    ``int8_vectorwise_dequant``. quanto: ``dequantize()`` of the weight as quanto deserializes it, in the scale's
    dtype (the model's)."""
    method = quantization_config(folder)["quant_method"]
    return _bitsandbytes_anchor(folder, default_backend) if method == "bitsandbytes" else _quanto_anchor(folder)


def _bitsandbytes_anchor(folder: Path, default_backend: bool) -> dict[str, torch.Tensor]:
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.functional import (
        QuantState,
        dequantize_4bit,
        dequantize_blockwise,
        get_4bit_type,
        int8_vectorwise_dequant,
    )

    stored = tensors(folder)
    found = {}
    for weight in quantized_weights(folder):
        layer = weight.removesuffix(".weight")
        if f"{layer}.SCB" in stored:
            found[weight] = int8_vectorwise_dequant(stored[weight], stored[f"{layer}.SCB"])
            continue
        parts = {key.removeprefix(weight + "."): value for key, value in stored.items() if key.startswith(weight + ".")}
        state = QuantState.from_dict(parts, device=torch.device("cpu"))
        state.dtype = torch.float32  # dequantize_4bit's result dtype: its float32 values, not rounded
        if not default_backend:
            found[weight] = dequantize_4bit(stored[weight], state)
            continue
        absmax = state.absmax
        if state.nested:
            absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
        code = get_4bit_type(state.quant_type, device="cpu")
        eager = _dequantize_4bit_compute.__wrapped__  # bitsandbytes compiles it where it can; the same code
        codes = stored[weight].view(torch.uint8).reshape(-1)  # as its registered kernel views a quant_storage dtype
        found[weight] = eager(codes, absmax, code, state.blocksize, state.shape, torch.float32)
    return found


def _quanto_anchor(folder: Path) -> dict[str, torch.Tensor]:
    from optimum.quanto import qtypes
    from optimum.quanto.tensor.weights import WeightQBitsTensor, WeightQBytesTensor

    qtype = qtypes[{"int8": "qint8", "float8": "qfloat8", "int4": "qint4", "int2": "qint2"}[
        quantization_config(folder)["weights_dtype"]
    ]]  # fmt: skip
    model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder))
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    stored = tensors(folder)
    found = {}
    for weight in quantized_weights(folder):
        size = shapes[weight]
        state = {key: value for key, value in stored.items() if key.startswith(weight + ".")}
        if qtype.bits == 8:
            tensor = WeightQBytesTensor.load_from_state_dict(
                state, weight + ".", qtype=qtype, axis=0, size=size, stride=(size[1], 1), activation_qtype=None,
                missing_keys=[],
            )  # fmt: skip
        else:
            group_size = _quanto_group_size(size[1])
            tensor = WeightQBitsTensor.load_from_state_dict(
                state, weight + ".", qtype=qtype, axis=0, group_size=group_size, size=size, stride=(size[1], 1),
                missing_keys=[],
            )  # fmt: skip
        found[weight] = tensor.dequantize()
    return found


def _quanto_group_size(in_features: int) -> int | None:
    """The group size quanto's ``QModuleMixin`` gives a 4- or 2-bit linear layer of ``in_features`` inputs."""
    group_size = 128
    if in_features <= group_size:
        return None
    while in_features % group_size and group_size > 32:
        group_size -= 32
    return group_size if in_features % group_size == 0 else None


# -- damaged copies --------------------------------------------------------------------------------------------------


def copy_folder(folder: Path, target: Path) -> Path:
    shutil.copytree(folder, target)
    return target


def rewrite(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite a model folder's checkpoint with ``change`` applied to its tensors (in place, metadata kept)."""
    from safetensors.torch import save_file

    with safe_open(folder / WEIGHTS, "pt") as file:
        metadata = file.metadata()
    values = tensors(folder)
    change(values)
    save_file(values, folder / WEIGHTS, metadata=metadata)


def truncate(folder: Path, keep: float = 0.5) -> None:
    path = folder / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def json_tensor(value: object) -> torch.Tensor:
    """A JSON value as bitsandbytes packs a quant state (``pack_dict_to_tensor``)."""
    return torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
