"""The roads a user takes with a pipeline whose weights a file or a library quantized, for every family of format
memmode reads: ComfyUI's mixed precision (a file of nvfp4, mxfp8, int8, awq and fp8 layers beside full-precision
ones), ModelOpt's NVFP4 export, bitsandbytes' double-quantized NF4 and quanto's int4 folders as diffusers saves
them. (GGUF files take each road in ``test_community_files_roads``, the i-quants among their types.)

Every family rests packed through the same machinery — a reader's codec behind a packed layer — so each road must
work for each as it does for GGUF and for memmode's own quantizers; what differs by family is the codec and the
parts a layer holds, and that is what these tests vary:

- **LoRA** (diffusers' ``load_lora_weights``): the adapter wraps the packed layer; group offload with a file
  storage gives the full load's output with the adapter; unloading gives the output without it back, still packed;
- **reads outside the forward**: ``state_dict()`` under group offload with ``disk`` gives the decoded weights the
  full load gives, never a stand-in's NaN;
- **torch.compile** of the transformer placed by group offload gives the uncompiled output;
- **ranks**: two gloo ranks load the same quantized folder with ``mmap``, each giving the single process's output.

Outputs are compared like with like: every mode against ``model_full_load`` of the same source (the same packed
tensors decoded by the same codec), bit for bit — under a file storage, the full load's weights moved into torch
memory first, aligned as the storage's files align them (``helpers.in_torch_memory``).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import memmode_core as memmode
from community_pipelines import FAMILY, lora_targets, make_lora, packed_layers, wide_wan_pipeline
from helpers import assert_bit_equal, in_torch_memory
from original_checkpoints import to_original, wan_plan
from ranks import distributed_available, run_ranks
from tiny_pipelines import run


@dataclass
class QuantizedPipeline:
    """The tiny Wan 2.2 pipeline's folder, with some transformers quantized in one family's format: in the folder
    (a library's save) or given as files (``files``: component -> path)."""

    folder: Path
    quantized: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)
    _full: dict[bool, torch.Tensor] = field(default_factory=dict)

    def load(self, mode: str, **kwargs):
        kwargs.setdefault("torch_dtype", torch.float32)
        handle = memmode.load(self.folder, mode, device="cpu", **self.files, **kwargs)
        handle.target.set_progress_bar_config(disable=True)
        return handle

    def full_load(self, in_memory: bool):
        """The pipeline under ``model_full_load``; ``in_memory``: its weights moved into torch memory, 64-byte
        aligned as a file storage's are (the files' own views are not: ``helpers.in_torch_memory``)."""
        pipe = self.load("model_full_load").target
        return in_torch_memory(pipe) if in_memory else pipe

    def full_load_output(self, in_memory: bool = False) -> torch.Tensor:
        """What every lossless mode gives: with a file storage, ``in_memory`` (like with like)."""
        if in_memory not in self._full:
            self._full[in_memory] = run(self.full_load(in_memory), FAMILY)
        return self._full[in_memory]


def _comfy_mixed() -> QuantizedPipeline:
    pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (ComfyUI's kernels) writes the ComfyUI files")
    from comfy_files import MIXED_LAYERS, write_comfy

    folder = Path(tempfile.mkdtemp(prefix="memmode-roads-comfy-"))
    atexit.register(shutil.rmtree, folder, True)
    pipe = wide_wan_pipeline()
    pipe.save_pretrained(folder)
    state = pipe.transformer.state_dict()
    original = to_original(wan_plan(list(state)), state)
    weights = [key for key, value in original.items() if key.endswith(".weight") and value.dim() == 2]
    cycle = [*MIXED_LAYERS, None]  # None: a layer left at full precision
    layers = {key: cycle[i % len(cycle)] for i, key in enumerate(weights) if cycle[i % len(cycle)] is not None}
    path = folder / "transformer-mixed.safetensors"
    write_comfy(path, original, layers)
    return QuantizedPipeline(folder, ("transformer",), {"transformer": str(path)})


def _modelopt_nvfp4() -> QuantizedPipeline:
    from quantized_folders import QUANTIZED, modelopt_folder

    return QuantizedPipeline(modelopt_folder("nvfp4").folder, QUANTIZED)


def _library_folder(method: str) -> Callable[[], QuantizedPipeline]:
    def make() -> QuantizedPipeline:
        pytest.importorskip("bitsandbytes", reason="bitsandbytes quantizes the fixture (requirements-test.txt)")
        pytest.importorskip("optimum.quanto", reason="optimum-quanto quantizes the fixture (requirements-test.txt)")
        from library_folders import pipeline_folder

        return QuantizedPipeline(pipeline_folder(method), ("transformer",))

    return make


#: each family, by a test id -> how its pipeline is made
SOURCES: dict[str, Callable[[], QuantizedPipeline]] = {
    "comfy_mixed": _comfy_mixed,
    "modelopt_nvfp4": _modelopt_nvfp4,
    "bnb_nf4_double": _library_folder("bnb_nf4_double"),
    "quanto_int4": _library_folder("quanto_int4"),
}
_MADE: dict[str, QuantizedPipeline] = {}


@pytest.fixture(params=list(SOURCES))
def source(request) -> QuantizedPipeline:
    if request.param not in _MADE:
        _MADE[request.param] = SOURCES[request.param]()
    return _MADE[request.param]


def options_for(storage: str, tmp_path: Path) -> dict:
    return {"storage": storage} | ({} if storage == "ram" else {"offload_dir": str(tmp_path / "offload")})


# -- LoRA ---------------------------------------------------------------------------------------------------------


def test_a_lora_runs_on_the_decoded_weights_and_unloading_gives_the_output_back(source, tmp_path):
    full = source.full_load(in_memory=True)
    full.load_lora_weights(make_lora(1), adapter_name="first")
    expected = run(full, FAMILY)

    handle = source.load("model_group_offload", **options_for("mmap", tmp_path))
    pipe = handle.target
    formats = packed_layers(pipe.transformer)
    pipe.load_lora_weights(make_lora(1), adapter_name="first")
    got = run(pipe, FAMILY)
    assert_bit_equal(got, expected, "group offload + mmap, with the adapter")
    assert (got - source.full_load_output(in_memory=True)).abs().max() > 1e-3, "the adapter took effect"
    wrapped = [path for path, _, _ in lora_targets() if path in formats]
    assert wrapped, "adapters on packed layers"
    for path in wrapped:
        layer = pipe.transformer.get_submodule(path)
        assert packed_layers(layer.base_layer) == {"": formats[path]}, f"{path}: the adapter wraps the packed layer"

    pipe.unload_lora_weights()
    assert_bit_equal(run(pipe, FAMILY), source.full_load_output(in_memory=True), "after unload_lora_weights")
    assert packed_layers(pipe.transformer) == formats, "still packed, every layer in its format"
    handle.remove()


# -- reads outside the forward ------------------------------------------------------------------------------------


def test_state_dict_under_a_file_storage_gives_the_decoded_weights_of_the_full_load(source, tmp_path):
    full = source.full_load(in_memory=False)
    expected = {name: getattr(full, name).state_dict() for name in source.quantized}
    handle = source.load("model_group_offload", **options_for("disk", tmp_path))
    for name in source.quantized:
        got = getattr(handle.target, name).state_dict()
        assert got.keys() == expected[name].keys(), name
        for key, value in got.items():
            assert_bit_equal(value, expected[name][key], f"{name}.{key}")
            if value.is_floating_point():
                assert torch.isfinite(value).all(), f"{name}.{key}: a stand-in's NaN"
    assert_bit_equal(run(handle.target, FAMILY), source.full_load_output(in_memory=True), "after the reads")
    handle.remove()


# -- torch.compile ------------------------------------------------------------------------------------------------


@pytest.fixture
def unprofiled_guards(monkeypatch):
    """Dynamo times every guard set it builds, for a log line: nothing checked here (see test_weight_changes)."""
    import torch._dynamo.guards

    monkeypatch.setattr(torch._dynamo.guards, "profile_guard_manager", lambda *args: 0.0, raising=False)


@pytest.mark.slow
def test_torch_compile_under_group_offload_gives_the_uncompiled_output(source, unprofiled_guards):
    import torch._dynamo

    handle = source.load("model_group_offload", storage="ram")
    pipe = handle.target
    torch._dynamo.reset()
    pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    try:
        # dynamo's eager backend runs the model's own operations on the same tensors: like with like
        assert_bit_equal(run(pipe, FAMILY), source.full_load_output(), "compiled")
    finally:
        pipe.transformer = pipe.transformer._orig_mod
        torch._dynamo.reset()
    assert packed_layers(pipe.transformer)
    handle.remove()


# -- ranks --------------------------------------------------------------------------------------------------------


def output_on_a_rank(rank: int, world: int, folder: str, files: dict[str, str]) -> torch.Tensor:
    """One rank loads the pipeline into group offload with ``mmap``: its output."""
    import memmode_core as memmode

    handle = memmode.load(
        folder, "model_group_offload", device="cpu", storage="mmap", torch_dtype=torch.float32, **files
    )
    handle.target.set_progress_bar_config(disable=True)
    output = run(handle.target, FAMILY)
    handle.remove()
    return output


@pytest.mark.slow
@pytest.mark.skipif(not distributed_available(), reason="needs torch.distributed with gloo")
def test_two_ranks_load_the_same_quantized_folder_each_giving_the_single_process_output():
    """A folder's checkpoint, mapped by each rank (a single file's road is GGUF's, in test_community_files_roads)."""
    family = "bnb_nf4_double"
    if family not in _MADE:
        _MADE[family] = SOURCES[family]()
    made = _MADE[family]
    for rank, output in enumerate(run_ranks(2, output_on_a_rank, str(made.folder), made.files)):
        assert_bit_equal(output, made.full_load_output(in_memory=True), f"rank {rank}")
