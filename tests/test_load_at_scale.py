"""Loading at the scale of the machine: a checkpoint as large as the RAM, a temporary folder smaller than
what a conversion writes, a process whose freed memory should go back.

- ``torch_dtype="auto"`` (the default) loads each model in its checkpoint's dtype: a bfloat16 checkpoint is
  bound as views, nothing converted; a conversion that is asked for says what it writes.
- Staging files: too little free space is refused before a byte is written, typed, naming the folder and
  the sizes; a write that fails anyway (a real file-size limit, an injected ENOSPC) is typed, names the
  file, and leaves nothing behind.
- A single-file checkpoint larger than RAM (sparse) opens, reads and loads where one private mapping of it
  fails.
- The load's report says how many groups were kept in the checkpoint's pages and how many written.
- In-memory quantization gives the freed C heap back (the measure: what a later ``malloc_trim`` returns).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

import memmode_core as memmode
from memmode_core.files import streamed
from memmode_core.files.checkpoint import Checkpoint
from memmode_core.files.mapping import MAP_WINDOW
from tiny_pipelines import make_pipeline, run

FAMILY = "wan22"


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    """The tiny Wan 2.2 pipeline saved in bfloat16 (its ``_keep_in_fp32_modules`` in float32)."""
    folder = tmp_path_factory.mktemp("bf16") / "pipe"
    make_pipeline(FAMILY, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def stamps(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: size and modification time (a checkpoint left untouched keeps both)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def reference(folder: Path, torch_dtype: torch.dtype | None) -> torch.Tensor:
    pipe = DiffusionPipeline.from_pretrained(folder, **({"torch_dtype": torch_dtype} if torch_dtype else {}))
    pipe.set_progress_bar_config(disable=True)
    memmode.apply(pipe, "model_group_offload", device="cpu", storage="mmap")
    return run(pipe, FAMILY)


def output(handle) -> torch.Tensor:
    handle.target.set_progress_bar_config(disable=True)
    return run(handle.target, FAMILY)


# -- torch_dtype="auto" ----------------------------------------------------------------------------------


def test_auto_loads_a_bf16_checkpoint_in_bf16_converting_nothing(bf16_folder, tmp_path, caplog):
    """Without torch_dtype, each model loads in its checkpoint's dtype: nothing is converted or staged, and the
    output is from_pretrained(torch_dtype=bfloat16) + apply's, bit for bit."""
    staging = tmp_path / "staging"
    with caplog.at_level(logging.INFO, logger="memmode"):
        handle = memmode.load(bf16_folder, "model_group_offload", device="cpu", storage="mmap", staging_dir=staging)
    loading = handle.report().loading
    assert loading["converted_bytes"] == 0 and loading["converted_tensors"] == 0, loading
    assert "converting" not in caplog.text and "nothing converted or staged" in caplog.text
    transformer = handle.target.transformer
    assert transformer.dtype == torch.bfloat16
    assert {p.dtype for p in transformer.parameters()} <= {torch.bfloat16, torch.float32}
    assert torch.equal(output(handle), reference(bf16_folder, torch.bfloat16))
    assert list(staging.iterdir()) == []


def test_a_conversion_says_what_it_writes(bf16_folder, tmp_path, caplog):
    """``torch_dtype=None`` (diffusers' default, float32) converts the bfloat16 tensors: the log says how many,
    from and to which dtype, and the bytes written, and the report counts them."""
    with caplog.at_level(logging.INFO, logger="memmode"):
        handle = memmode.load(
            bf16_folder, "model_group_offload", device="cpu", storage="mmap", torch_dtype=None, staging_dir=tmp_path
        )
    loading = handle.report().loading
    assert loading["converted_tensors"] > 0 and loading["converted_bytes"] > 0, loading
    lines = [r.getMessage() for r in caplog.records if "converting" in r.getMessage()]
    assert lines and all("from bfloat16 to float32" in line and "bytes) to a staging file in" in line for line in lines)
    assert sum(int(line.split(" (")[2].split(" bytes")[0]) for line in lines) == loading["converted_bytes"]
    assert torch.equal(output(handle), reference(bf16_folder, None))
    with pytest.raises(memmode.InvalidOptionError, match="auto"):
        memmode.load(bf16_folder, "model_group_offload", torch_dtype="bf16")


def test_auto_takes_the_dtype_of_the_weights_not_of_the_float32_modules(tmp_path):
    """A small bfloat16 model whose ``_keep_in_fp32_modules`` hold most of its bytes is still a bfloat16
    checkpoint: those modules are float32 in any checkpoint, so "auto" does not count them."""
    from safetensors.torch import save_file

    save_file(
        {
            "blocks.0.attn.weight": torch.zeros(8, 8, dtype=torch.bfloat16),
            "blocks.0.norm1.weight": torch.zeros(64, 64),
            "packed.weight_packed": torch.zeros(256, 256, dtype=torch.float8_e4m3fn),
        },
        tmp_path / "model.safetensors",
    )
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.floating_dtype() == torch.float32
    assert checkpoint.floating_dtype(("norm1",)) == torch.bfloat16


# -- staging files: room and write failures ---------------------------------------------------------------


def _little_room(monkeypatch, under: Path, free: int) -> None:
    """shutil.disk_usage reports ``free`` bytes for every folder under ``under`` (the real one elsewhere)."""
    import shutil

    usage, real = namedtuple("usage", "total used free"), shutil.disk_usage
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: usage(1 << 40, (1 << 40) - free, free) if str(path).startswith(str(under)) else real(path),
    )


@pytest.mark.parametrize("what", ["conversion", "quantization"])
def test_too_little_room_for_staging_is_refused_before_anything_is_written(what, bf16_folder, tmp_path, monkeypatch):
    staging = tmp_path / "staging"
    _little_room(monkeypatch, staging, 4096)
    before = stamps(bf16_folder)
    if what == "conversion":
        mode, kwargs = "model_group_offload", {"torch_dtype": torch.float32}
    else:
        mode, kwargs = "model_group_offload_and_qfloat8", {}
    with pytest.raises(memmode.StagingError) as caught:
        memmode.load(bf16_folder, mode, device="cpu", storage="mmap", staging_dir=staging, **kwargs)
    error = caught.value
    assert isinstance(error, memmode.StorageUnavailableError)
    assert error.folder == str(staging) and error.free == 4096 and error.needed > 4096
    message = str(error)
    assert str(staging) in message and f"{error.needed} bytes" in message and "4096 bytes) free" in message
    assert ("converting" if what == "conversion" else "quantizing transformer") in message
    assert list(staging.iterdir()) == [], "nothing was written"
    assert stamps(bf16_folder) == before


def test_a_failed_staging_write_is_typed_names_the_file_and_leaves_nothing(bf16_folder, tmp_path, monkeypatch):
    """The disk fills up half-way through a conversion (ENOSPC from the third write): a StagingError naming the
    staging file, no file left in the folder, the checkpoint untouched."""
    staging = tmp_path / "staging"
    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(streamed.os, "pwrite", pwrite)
    before = stamps(bf16_folder)
    with pytest.raises(memmode.StagingError, match="No space left on device") as caught:
        memmode.load(
            bf16_folder,
            "model_group_offload",
            device="cpu",
            storage="mmap",
            staging_dir=staging,
            torch_dtype=torch.float32,
        )
    assert caught.value.path.startswith(str(staging / "memmode-loading-")) and caught.value.path in str(caught.value)
    assert list(staging.iterdir()) == []
    assert stamps(bf16_folder) == before


_FSIZE_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    import memmode_core as memmode
    folder, staging = sys.argv[1], sys.argv[2]
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))  # files of 16 KiB at most
    try:
        memmode.load(folder, "model_group_offload", device="cpu", storage="ram", staging_dir=staging,
                     torch_dtype=torch.float32)
    except memmode.StagingError as exc:
        print("StagingError", exc.path, "|", exc)
    else:
        print("loaded")
""")


def test_a_file_size_limit_is_a_staging_error_with_nothing_left_behind(bf16_folder, tmp_path):
    """A real limit (RLIMIT_FSIZE, in a child): writing the conversion file fails with EFBIG, which becomes a
    StagingError naming the file; the staging folder is left empty."""
    staging = tmp_path / "staging"
    staging.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_SCRIPT, str(bf16_folder), str(staging)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"StagingError {staging}/memmode-loading-"), out.stdout
    assert "File too large" in out.stdout
    assert list(staging.iterdir()) == []


# -- a single-file checkpoint larger than RAM --------------------------------------------------------------


def _ram_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_a_sparse_checkpoint_larger_than_ram_opens_and_reads(tmp_path):
    """A safetensors file whose tensors total more than the machine's RAM (32 GiB or 1.25x RAM, whichever is
    larger; sparse: its data takes no disk). One private mapping of it is refused by Linux's default
    overcommit; the checkpoint is mapped in windows, so every tensor can be viewed at once (what binding a
    model does) and one far into the file reads back as its bytes: zeros. Nothing is read in full."""
    tensor_bytes = 256 << 20
    count = -(-max(32 << 30, _ram_bytes() * 5 // 4) // tensor_bytes)
    header = {
        f"blocks.{i}.weight": {
            "dtype": "BF16",
            "shape": [tensor_bytes // 2 // 4096, 4096],
            "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes],
        }
        for i in range(count)
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    try:
        with open(path, "wb") as file:
            file.write(struct.pack("<Q", len(text)) + text)
            file.truncate(8 + len(text) + count * tensor_bytes)
        assert path.stat().st_size > _ram_bytes() and path.stat().st_blocks * 512 < (1 << 20), "sparse"
        checkpoint = Checkpoint.open(tmp_path)
        last = checkpoint.view(f"blocks.{count - 1}.weight")
        assert len(checkpoint.files[0].mappings) == 1, "only the window read is mapped"
        views = [checkpoint.view(key) for key in checkpoint.keys()]  # every window at once: > RAM of mappings
        windows = checkpoint.files[0].mappings
        assert sum(w.numel() for w in windows) >= count * tensor_bytes > _ram_bytes()
        assert max(w.numel() for w in windows) <= MAP_WINDOW
        assert last.dtype == torch.bfloat16 and last.shape == (tensor_bytes // 2 // 4096, 4096)
        tail = last[-16:]  # the last 128 KiB of the file, 32+ GiB in
        assert torch.equal(tail.view(torch.int16), torch.zeros_like(tail, dtype=torch.int16))
        del views, windows, last, tail
        checkpoint.release()
    finally:
        path.unlink(missing_ok=True)


def test_a_wan_14b_shaped_single_file_checkpoint_larger_than_ram_loads(tmp_path):
    """A single-file checkpoint of a Wan 2.1 14B-shaped transformer in bfloat16, with as many blocks as it
    takes to outgrow the machine's RAM (40, 26.6 GiB, on a 24 GB machine; sparse). ``load`` once failed on it
    with a raw ``OSError`` (ENOMEM: one private mapping larger than RAM); now it loads, keeping every group
    in the checkpoint's pages, with a few hundred MiB of anonymous memory and nothing but the
    ``_keep_in_fp32_modules`` converted. No weight is read (no forward: the data are holes)."""
    from diffusers import WanTransformer3DModel

    config = {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 13824,
        "num_layers": 1,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }
    with torch.device("meta"):
        one = sum(t.numel() * 2 for t in WanTransformer3DModel.from_config(config).state_dict().values())
        config["num_layers"] = max(40, -(-_ram_bytes() * 9 // 8 // one))
        model = WanTransformer3DModel.from_config(config)
    folder = tmp_path / "transformer"
    model.save_config(folder)
    header, offset = {}, 0
    for key, tensor in model.state_dict().items():
        size = tensor.numel() * 2
        header[key] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    del model
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    path = folder / "diffusion_pytorch_model.safetensors"
    try:
        with open(path, "wb") as file:
            file.write(struct.pack("<Q", len(text)) + text)
            file.truncate(8 + len(text) + offset)
        assert path.stat().st_size > _ram_bytes()
        handle = memmode.load(
            folder, "model_group_offload", device="cpu", storage="mmap", in_place=True, offload_dir=tmp_path / "o"
        )
        loading = handle.report().loading
        assert loading["written_groups"] == 0 and loading["kept_in_place_bytes"] > _ram_bytes() * 0.9, loading
        assert loading["converted_bytes"] < 256 << 20, "only the float32 modules are converted"
        assert handle.target.dtype == torch.bfloat16
        del handle  # not remove(): that would restore the weights into RAM, all 26.6 GiB of them
    finally:
        path.unlink(missing_ok=True)


# -- what in_place did ------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [None, True])
def test_the_report_says_what_was_kept_in_place_and_what_was_written(in_place, bf16_folder, tmp_path, caplog):
    """On a CPU device the default keeps only 64-byte aligned groups in place (none of a save_pretrained
    checkpoint); ``in_place=True`` keeps them all. The report and the log say which, in groups and bytes."""
    with caplog.at_level(logging.INFO, logger="memmode"):
        handle = memmode.load(
            bf16_folder, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path, in_place=in_place
        )
    loading, stats = handle.report().loading, handle.report().storage_bytes
    assert loading["kept_in_place_bytes"] == stats["borrowed_bytes"]
    assert loading["written_bytes"] == stats["disk_bytes"]
    assert loading["kept_in_place_groups"] + loading["written_groups"] > 0
    if in_place:
        assert loading["kept_in_place_groups"] > 0 and loading["kept_in_place_bytes"] > 0, loading
    else:
        assert loading["kept_in_place_groups"] == 0 and loading["written_groups"] > 0, loading
    said = f"{loading['kept_in_place_groups']} groups ("
    assert said in caplog.text and "kept in the checkpoint's pages" in caplog.text
    assert f"{loading['written_groups']} groups (" in caplog.text


def test_groups_written_from_a_checkpoint_mapped_in_windows_hold_each_window_s_bytes(
    bf16_folder, tmp_path, monkeypatch
):
    """A large checkpoint is mapped in windows, each from its own offset of the file: the weights a load writes
    are the right bytes of the file (``verify="hash"`` checks every group file's bytes against its name at each
    onload), and outputs equal from_pretrained + apply."""
    from memmode_core.files.mapping import Windows

    monkeypatch.setattr(Windows.__init__, "__defaults__", (64 << 10,))  # windows of 64 KiB: many, far into it
    handle = memmode.load(
        bf16_folder, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path, verify="hash"
    )
    assert handle.report().storage_bytes["disk_bytes"] > 0
    assert torch.equal(output(handle), reference(bf16_folder, torch.bfloat16))


# -- freed heap after in-memory quantization ---------------------------------------------------------------


_TRIM_SCRIPT = textwrap.dedent("""
    import gc, sys, torch
    import memmode_core as memmode
    from memmode_core.files import streamed
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    trim = streamed._TRIM
    if sys.argv[1] == "off":
        streamed._TRIM = None  # what quantizing did before it gave the heap back
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(32)]).eval()
    memmode.apply(model, "model_full_load_and_qfloat8", device="cpu")
    gc.collect()
    before = anon(); trim(0)
    print(before - anon())
""")


@pytest.mark.skipif(streamed._TRIM is None, reason="no glibc malloc_trim here")
def test_quantizing_in_memory_gives_the_freed_heap_back():
    """A 512 MiB float32 model quantized to qfloat8 in memory, in a child: afterwards a malloc_trim finds nothing
    left to return. Without the trim quantizing now does, it returned 28-240 MiB (measured, 32 layers)."""
    # both children at once: each spends most of its time importing
    children = {
        trim: subprocess.Popen(
            [sys.executable, "-c", _TRIM_SCRIPT, trim], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for trim in ("on", "off")
    }
    retained = {}
    for trim, child in children.items():
        stdout, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, stderr[-2000:]
        retained[trim] = int(stdout.split()[-1])
    assert retained["on"] <= 4 << 20, retained
    assert retained["off"] > retained["on"] + (8 << 20), f"the measure tells the two apart: {retained}"
