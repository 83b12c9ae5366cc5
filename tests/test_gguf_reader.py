"""memmode-gguf's reader and codecs against gguf-py: GGUF files written as city96's converter writes them
(``tests/gguf_files.py``) are read by :class:`memmode_gguf.GgufReader` from their header, and every tensor, decoded
by its codec from the file's own bytes, is bit for bit what ``gguf.quants.dequantize`` makes of them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import memmode_core
from gguf_files import (
    GRID_TYPES,
    IQ4_TYPES,
    SUPPORTED_TYPES,
    quantize_blocks,
    random_iq_blocks,
    reference_dequantize,
    write_gguf,
)
from helpers import requires_cuda
from memmode_core.plugin import PAYLOAD, CheckpointError, EncodedTensor, FileContents, StoredTensor
from memmode_gguf import BLOCK_TYPES, CODECS, GgufReader, codec_for, dequantize
from memmode_gguf.reader import ORIG_SHAPE_KEY

BLOCK_QTYPES = [t for t in SUPPORTED_TYPES if t.name in BLOCK_TYPES]
PLAIN_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def normal(*shape: int, seed: int = 0) -> np.ndarray:
    """Gaussian values of a few scales per row, one row shifted positive and one negative (the affine types'
    minimum), one of zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 2, (*shape[:-1], 1)).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] >= 3:
        flat[0] += 3 * np.abs(flat[0]).max()
        flat[1] -= 3 * np.abs(flat[1]).max()
        flat[2] = 0
    return x


def file_bytes(path) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def stored_value(data: torch.Tensor, tensor: StoredTensor) -> torch.Tensor:
    """The stored tensor as the file's bytes say: ``dtype`` and ``shape`` over ``start:end``."""
    return data[tensor.start : tensor.end].clone().view(tensor.dtype).view(tensor.shape)


def decoded(contents: FileContents, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the file: the encoded ones decoded by their codec from views of the file's bytes, the stored
    ones that are no part of an encoded one as they are (in float32)."""
    parts = {key for tensor in contents.encoded.values() for key in tensor.parts.values()}
    out = {}
    for key, tensor in contents.encoded.items():
        packed = {name: stored_value(data, contents.stored[part]) for name, part in tensor.parts.items()}
        out[key] = tensor.codec.unpack(packed, torch.Size(tensor.shape), dtype)
    for key, tensor in contents.stored.items():
        if key not in parts:
            out[key] = stored_value(data, tensor).float()
    return out


def assert_bits(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit for bit, the sign of every zero included."""
    assert got.dtype == expected.dtype == torch.float32 and got.shape == expected.shape, (what, got.shape)
    same = got.view(torch.int32) == expected.view(torch.int32)
    assert bool(same.all()), f"{what}: {int((~same).sum())} values differ, by up to {(got - expected).abs().max()}"


def read_and_compare(path) -> FileContents:
    contents = GgufReader().read(path)
    assert contents.size == path.stat().st_size
    got, expected = decoded(contents, file_bytes(path)), reference_dequantize(path)
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert_bits(got[key], expected[key], key)
    return contents


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_every_type_reads_bit_equal_to_gguf_py(tmp_path, qtype):
    path = tmp_path / f"x-{qtype.name}.gguf"
    tensors = {"blocks.0.attn.to_q.weight": (normal(24, 1024), qtype), "blocks.0.attn.to_q.bias": (normal(24), qtype)}
    stored = write_gguf(path, tensors, arch="flux", metadata={"test.note": "fixture", "test.count": 3})
    assert stored["blocks.0.attn.to_q.weight"] == qtype and stored["blocks.0.attn.to_q.bias"] == Q.F32
    contents = read_and_compare(path)

    assert contents.metadata["general.architecture"] == "flux"
    assert contents.metadata["test.note"] == "fixture" and contents.metadata["test.count"] == "3"
    bias = contents.stored["blocks.0.attn.to_q.bias"]
    assert (bias.dtype, bias.shape, bias.nbytes) == (torch.float32, (24,), 24 * 4)
    key = "blocks.0.attn.to_q.weight"
    if qtype in PLAIN_DTYPES:
        weight = contents.stored[key]
        assert key not in contents.encoded
        assert (weight.dtype, weight.shape) == (PLAIN_DTYPES[qtype], (24, 1024))
        assert weight.nbytes == 24 * 1024 * PLAIN_DTYPES[qtype].itemsize
        return
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    weight = contents.encoded[key]
    assert isinstance(weight, EncodedTensor)
    assert (weight.shape, weight.dtype, dict(weight.parts)) == ((24, 1024), torch.float32, {PAYLOAD: f"{key}:blocks"})
    assert weight.codec is CODECS[qtype.name] is codec_for(qtype.name)
    assert weight.codec.name == weight.codec.format_name == f"gguf_{qtype.name.lower()}" and not weight.codec.packs
    blocks = contents.stored[f"{key}:blocks"]
    assert (blocks.dtype, blocks.shape, blocks.nbytes) == (
        torch.uint8,
        (24, 1024 // block * size),
        24 * 1024 // block * size,
    )
    assert key not in contents.stored


def test_tensors_stored_reshaped_come_back_in_their_real_shape(tmp_path):
    path = tmp_path / "sdxl.gguf"
    tensors = {
        "conv.weight": (normal(64, 8, 3, 3, seed=1), Q.Q4_K),  # 4608 elements: 18 rows of 256
        "proj.weight": (normal(32, 40, seed=2), Q.Q8_0),  # 1280: 5 rows of 256
        "small.weight": (normal(16, 48, seed=3), Q.Q8_0),  # 768: F32, rows of 256 too
    }
    stored = write_gguf(path, tensors, arch="sdxl", reshape_rows_to=256)
    assert stored == {"conv.weight": Q.Q4_K, "proj.weight": Q.Q8_0, "small.weight": Q.F32}
    contents = read_and_compare(path)
    assert contents.encoded["conv.weight"].shape == (64, 8, 3, 3)
    assert contents.stored["conv.weight:blocks"].shape == (18, 144)
    assert contents.encoded["proj.weight"].shape == (32, 40)
    assert contents.stored["proj.weight:blocks"].shape == (5, 8 * 34)
    assert contents.stored["small.weight"].shape == (16, 48)
    assert not any(key.startswith(ORIG_SHAPE_KEY) and len(value) > 200 for key, value in contents.metadata.items())


def test_every_type_in_one_file(tmp_path):
    path = tmp_path / "mixed.gguf"
    tensors = {f"blocks.{i}.weight": (normal(8, 512, seed=i), qtype) for i, qtype in enumerate(SUPPORTED_TYPES)}
    tensors["norm.weight"] = (normal(512), Q.Q4_K)
    write_gguf(path, tensors, arch="wan")
    contents = read_and_compare(path)
    assert {key: t.codec.name for key, t in contents.encoded.items()} == {
        f"blocks.{i}.weight": f"gguf_{qtype.name.lower()}"
        for i, qtype in enumerate(SUPPORTED_TYPES)
        if qtype not in PLAIN_DTYPES
    }


@pytest.mark.parametrize(
    "shape",
    [(1, 256), (1, 256 * 64), (3, 1, 512), (2, 3, 768), (5, 2, 2, 256)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda t: t.name)
def test_odd_shapes(tmp_path, qtype, shape):
    path = tmp_path / "odd.gguf"
    write_gguf(path, {"w": (normal(*shape, seed=7), qtype)}, arch="flux")
    contents = read_and_compare(path)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if "w" in contents.encoded:  # 256 elements: kept in F32 by the converter's rule
        assert contents.encoded["w"].shape == shape
        assert contents.stored["w:blocks"].shape == (*shape[:-1], shape[-1] // block * size)


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda t: t.name)
def test_dequantize_takes_any_bytes_of_whole_blocks(qtype):
    """Any shape of whole blocks, a view at any byte offset (the float16 scales unaligned), non-contiguous rows."""
    x = normal(6, 512, seed=11)
    data = quantize_blocks(x, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    blocks = torch.from_numpy(data)
    assert_bits(dequantize(blocks, qtype.name), expected, "rows")
    assert_bits(dequantize(blocks.reshape(-1), qtype.name), expected.reshape(-1), "flat")
    odd = torch.empty(blocks.numel() + 1, dtype=torch.uint8)[1:]
    odd.copy_(blocks.reshape(-1))
    assert_bits(dequantize(odd, qtype.name), expected.reshape(-1), "at an odd offset")
    assert_bits(dequantize(blocks[::2], qtype.name), expected[::2], "every other row")
    half = blocks.shape[1] // 2
    assert_bits(dequantize(blocks[:, :half], qtype.name), expected[:, :256], "half rows")  # 256: whole blocks
    assert dequantize(blocks[:0], qtype.name).shape == (0, 512)


@pytest.mark.parametrize("qtype", IQ4_TYPES + GRID_TYPES, ids=lambda t: t.name)
def test_i_quants_of_random_bytes_are_bit_equal(qtype, tmp_path, monkeypatch):
    """Blocks of random bytes (every code, grid index, sign and sub-block scale; ``d`` of either sign, zeros and
    subnormals among them), decoded directly and from a file of several rows of several blocks: gguf-py's values,
    every zero's sign included; decoded by the codec in chunks that end mid-row, the same bits, and in bfloat16 the
    float32 values rounded once."""
    import memmode_gguf.codec

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = random_iq_blocks(np.random.default_rng(17), 4096 // block * 12, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    assert_bits(dequantize(torch.from_numpy(data), qtype.name), expected, qtype.name)
    path = tmp_path / "random.gguf"
    write_raw(path, {"w": (data.reshape(12, 4096 // block * size), qtype)})
    contents = read_and_compare(path)
    assert (
        contents.encoded["w"].shape == (12, 4096) and contents.encoded["w"].codec.name == f"gguf_{qtype.name.lower()}"
    )
    codec, rows = codec_for(qtype.name), torch.from_numpy(data).view(12, -1)
    monkeypatch.setattr(memmode_gguf.codec, "CHUNK_BLOCKS", 5)
    assert_bits(codec.unpack({PAYLOAD: rows}, torch.Size((12, 4096)), torch.float32), expected.view(12, 4096), "chunks")
    assert torch.equal(
        codec.unpack({PAYLOAD: rows}, torch.Size((12, 4096)), torch.bfloat16), expected.view(12, 4096).bfloat16()
    )


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda t: t.name)
def test_codecs_decode_to_the_compute_dtype(qtype):
    x = normal(4, 512, seed=5)
    blocks = torch.from_numpy(quantize_blocks(x, qtype))
    codec = codec_for(qtype.name)
    exact = codec.unpack({PAYLOAD: blocks}, torch.Size((4, 512)), torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        got = codec.unpack({PAYLOAD: blocks}, torch.Size((4, 512)), dtype)
        assert got.dtype == dtype and torch.equal(got, exact.to(dtype))
    assert codec.unpack({PAYLOAD: blocks.reshape(-1)}, torch.Size((2, 2, 512)), torch.float32).shape == (2, 2, 512)
    with pytest.raises(NotImplementedError, match="GGUF"):
        codec.pack(torch.zeros(4, 512))


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda t: t.name)
def test_a_large_weight_decodes_in_chunks_to_the_same_bits(qtype, monkeypatch):
    """A weight of more than ``CHUNK_BLOCKS`` blocks is decoded a chunk at a time into the result (the float32
    values of a whole layer are never alive beside it): the same bits as decoding it whole, in every dtype."""
    import memmode_gguf.codec

    x = normal(6, 1024, seed=7)
    blocks = torch.from_numpy(quantize_blocks(x, qtype))
    codec = codec_for(qtype.name)
    whole = {
        dtype: codec.unpack({PAYLOAD: blocks}, torch.Size((6, 1024)), dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }
    monkeypatch.setattr(memmode_gguf.codec, "CHUNK_BLOCKS", 5)  # chunks that end mid-row, and a short last one
    for dtype, expected in whole.items():
        assert torch.equal(codec.unpack({PAYLOAD: blocks}, torch.Size((6, 1024)), dtype), expected)


@requires_cuda("the decoding on the compute device")
@pytest.mark.parametrize("qtype", BLOCK_QTYPES + list(GRID_TYPES), ids=lambda t: t.name)
def test_dequantize_on_cuda_is_bit_equal(qtype):
    if qtype in GRID_TYPES:
        data = random_iq_blocks(np.random.default_rng(13), 256, qtype)
    else:
        data = quantize_blocks(normal(64, 1024, seed=13), qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    got = dequantize(torch.from_numpy(data).cuda(), qtype.name)
    assert got.device.type == "cuda"
    assert_bits(got.cpu(), expected, qtype.name)


# -- what is refused ------------------------------------------------------------------------------------------


def small_file(path, qtypes=(Q.Q4_K, Q.Q8_0)) -> None:
    write_gguf(path, {f"w{i}": (normal(8, 512, seed=i), qtype) for i, qtype in enumerate(qtypes)}, arch="flux")


def test_reads_only_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    small_file(path)
    reader = GgufReader()
    assert reader.suffixes == (".gguf",) and reader.name == "gguf"
    head = path.read_bytes()[:64]
    assert reader.reads(path, head)
    assert not reader.reads(path, b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    not_gguf = tmp_path / "x.safetensors"
    not_gguf.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        reader.read(not_gguf)


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "x.gguf"
    small_file(path)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match=r"x\.gguf: tensor 'w1' .*past the end of the file.*truncated"):
        GgufReader().read(path)
    path.write_bytes(data[:200])  # the header itself cut short
    with pytest.raises(CheckpointError, match=r"x\.gguf"):
        GgufReader().read(path)


@pytest.mark.parametrize("at", [0, 4, 15, 23], ids=["magic", "version", "tensor count", "kv count"])
def test_a_damaged_header_is_refused(tmp_path, at):
    path = tmp_path / "x.gguf"
    small_file(path)
    data = bytearray(path.read_bytes())
    data[at] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"x\.gguf"):
        GgufReader().read(path)


def write_raw(path, tensors, fields=()) -> None:
    """A GGUF file of raw tensors (name: (uint8 bytes in GGUF's byte shape, type)) and extra array fields."""
    writer = gguf.GGUFWriter(path=None, arch="flux")
    for key, values in fields:
        writer.add_array(key, values)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_type_it_cannot_decode_is_refused_naming_it(tmp_path):
    path = tmp_path / "tq.gguf"
    ok = quantize_blocks(normal(4, 256), Q.Q4_K)
    size = gguf.GGML_QUANT_SIZES[Q.TQ1_0][1]
    write_raw(path, {"fine.weight": (ok, Q.Q4_K), "odd.weight": (np.zeros((4, size), np.uint8), Q.TQ1_0)})
    with pytest.raises(CheckpointError) as refused:
        GgufReader().read(path)
    message = str(refused.value)
    assert "tq.gguf" in message and "'odd.weight'" in message and "TQ1_0" in message
    assert all(name in message for name in ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ2_XXS"))


def test_an_orig_shape_of_another_size_is_refused(tmp_path):
    path = tmp_path / "shape.gguf"
    data = quantize_blocks(normal(4, 256), Q.Q4_K)
    write_raw(path, {"w": (data, Q.Q4_K)}, fields=[(ORIG_SHAPE_KEY + "w", [32, 40])])
    with pytest.raises(CheckpointError, match=r"shape\.gguf: comfy\.gguf\.orig_shape\.w .*\(32, 40\).*1024 values"):
        GgufReader().read(path)
    write_raw(path, {"w": (data, Q.Q4_K)}, fields=[(ORIG_SHAPE_KEY + "w", [32, 32])])
    assert GgufReader().read(path).encoded["w"].shape == (32, 32)


def test_listed_as_a_reader_of_memmode_gguf():
    rows = [row for row in memmode_core.list_plugins() if row.kind == "reader" and row.name == "gguf"]
    assert len(rows) == 1
    assert rows[0].distribution == "memmode-gguf" and rows[0].available
