"""Safetensors checkpoints read without loading them: headers first, tensors as views of a private mapping.

Loading straight into a mode (:mod:`memmode_core.loading`) needs two things from a checkpoint that
``safetensors.torch.load_file`` does not give separately: every tensor's name, dtype, shape and byte range
*before* any weight is read (to plan, to check the checkpoint is whole, to pick what to convert), and each
tensor as a view of the file's pages, so that binding a weight costs no anonymous memory: the page cache,
which the kernel can evict and re-read, is the only copy.

- **Checked up front.** Every header is parsed and every byte range checked against the file's size
  before anything is mapped: a truncated shard is a :class:`CheckpointError` naming it, never a SIGBUS
  half-way through a forward.
- **Private mappings, in windows.** Files are mapped copy-on-write
  (:func:`~memmode_core.files.mapping.map_private`): an in-place write into a weight copies that page into
  the process and never reaches the checkpoint. Each file is mapped in windows of about 1 GiB
  (:class:`~memmode_core.files.mapping.Windows`), each when a tensor in it is first read: Linux's default
  overcommit refuses one private mapping larger than RAM, and a single-file checkpoint can be larger.
- **Sharded checkpoints** are read through their ``*.safetensors.index.json``; a key found in two files,
  or an index naming a missing file, is refused.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memmode_core.contracts.errors import CheckpointError
from memmode_core.files.file_layout import DTYPE_NAMES, PADDING_PREFIX
from memmode_core.files.mapping import Windows, map_private_range
from memmode_core.files.naming import file_identity

#: safetensors dtype name -> torch dtype (the inverse of the names the group files write)
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: a header larger than this is not a safetensors header (the format's own limit is 100 MB)
MAX_HEADER_BYTES = 100_000_000
#: the file names diffusers and transformers give a component's weights, in the order they are looked for
WEIGHT_NAMES = ("diffusion_pytorch_model", "model")
METADATA_KEY = "__metadata__"
#: the dtypes a model can be built in (``torch.set_default_dtype``); a tie goes to the later one
BUILD_DTYPES = (torch.float64, torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor of a checkpoint is: its file, dtype, shape and absolute byte range."""

    key: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def is_view(self) -> bool:
        """Read as a view of the file's pages (always: a stored tensor is one byte range)."""
        return True


@dataclass
class CheckpointFile:
    """One safetensors file: its header, checked against its size; mapped on first use."""

    path: Path
    records: dict[str, TensorRecord]
    metadata: dict[str, str]
    size: int
    _windows: Windows | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> CheckpointFile:
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as file:
                prefix = file.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
                (header_bytes,) = struct.unpack("<Q", prefix)
                if header_bytes > min(MAX_HEADER_BYTES, size - 8):
                    raise CheckpointError(
                        f"{path}: not a safetensors file, or truncated (its header claims "
                        f"{header_bytes} bytes and the file has {size})"
                    )
                raw = file.read(header_bytes)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not a safetensors file (its header is not valid JSON: {exc})") from None
        data_start = 8 + header_bytes
        metadata = header.pop(METADATA_KEY, None) or {}
        records = {}
        for key, entry in header.items():
            if key.startswith(PADDING_PREFIX):
                continue  # the zero bytes memmode's own files use to align tensors
            try:
                dtype = TORCH_DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{path}: tensor {key!r} has a header entry memmode cannot read: {entry!r} "
                    f"(unknown dtype, or not safetensors)"
                ) from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0:
                raise CheckpointError(
                    f"{path}: tensor {key!r} has {end - begin} bytes for a {list(shape)} "
                    f"{entry['dtype']} tensor (a damaged header)"
                )
            if data_start + end > size:
                raise CheckpointError(
                    f"{path} is truncated: tensor {key!r} ends at byte {data_start + end} and the file has {size} bytes"
                )
            records[key] = TensorRecord(key, path, dtype, shape, data_start + begin, data_start + end)
        return cls(path, records, {str(k): str(v) for k, v in metadata.items()}, size)

    @classmethod
    def of_records(
        cls, path: str | os.PathLike, records: Iterable[TensorRecord], metadata: Mapping[str, str], size: int
    ) -> CheckpointFile:
        """A file whose header a reader plugin parsed (:mod:`memmode_core.contracts.reader`): its records are
        checked here as a safetensors header is, each byte range against the file's size and against its dtype
        and shape, so that a reader's mistake is a :class:`CheckpointError` too, never a read past the end."""
        path = Path(path)
        try:
            actual = path.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        if actual != size:
            raise CheckpointError(f"{path} has {actual} bytes, and its header was read from {size}: it changed")
        checked = {}
        for record in records:
            numel = 1
            for d in record.shape:
                numel *= d
            if record.end - record.start != numel * record.dtype.itemsize or record.start < 0:
                raise CheckpointError(
                    f"{path}: tensor {record.key!r} has {record.end - record.start} bytes for a "
                    f"{list(record.shape)} {str(record.dtype).removeprefix('torch.')} tensor (a damaged header)"
                )
            if record.end > size:
                raise CheckpointError(
                    f"{path} is truncated: tensor {record.key!r} ends at byte {record.end} and the file has "
                    f"{size} bytes"
                )
            checked[record.key] = TensorRecord(
                record.key, path, record.dtype, tuple(record.shape), record.start, record.end
            )
        return cls(path, checked, {str(k): str(v) for k, v in metadata.items()}, size)

    def check(self) -> None:
        """Refuse the file if it changed size since its header was read (it is about to be mapped)."""
        try:
            now = self.path.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot be read ({exc.strerror or exc})") from None
        if now != self.size:
            raise CheckpointError(
                f"{self.path} changed while loading: {now} bytes, {self.size} when its header was read"
            )

    def view(self, key: str) -> torch.Tensor:
        """The tensor as a view of this file's private mapping (a copy only where it is not aligned)."""
        record = self.records[key]
        if record.nbytes == 0:
            return torch.empty(record.shape, dtype=record.dtype)
        if self._windows is None:
            self.check()
            self._windows = Windows((r.start, r.end) for r in self.records.values())
        try:
            raw = self._windows.slice(record.start, record.end, self._map_window)
        except OSError as exc:
            raise CheckpointError(
                f"{self.path}: cannot be mapped ({exc.strerror or exc}) to read tensor {key!r}"
            ) from None
        if record.start % record.dtype.itemsize:
            raw = raw.clone()  # safetensors does not promise alignment; a misaligned tensor costs its size
        return raw.view(record.dtype).view(record.shape)

    def _map_window(self, offset: int, length: int) -> torch.Tensor:
        return map_private_range(self.path, offset, length)

    @property
    def mappings(self) -> list[torch.Tensor]:
        """The windows of the file mapped so far (those a view was taken from), each as ``uint8``."""
        return self._windows.mapped if self._windows is not None else []

    def release(self) -> None:
        """Drop this file's mappings (the views handed out keep theirs alive as long as they live)."""
        self._windows = None


class Checkpoint:
    """The weights of one model: one safetensors file, or the shards an index names."""

    def __init__(self, files: list[CheckpointFile], where: Path) -> None:
        self.files = files
        self.where = where
        self._by_key: dict[str, CheckpointFile] = {}
        for file in files:
            for key in file.records:
                other = self._by_key.setdefault(key, file)
                if other is not file:
                    raise CheckpointError(f"{where}: tensor {key!r} is in both {other.path.name} and {file.path.name}")

    def identity(self) -> tuple:
        """What names the weights without reading them: each file's path, device, inode, size and modification
        time (the ranks of one machine agree on it before packing: :mod:`memmode_core.files.made_once`)."""
        return tuple(file_identity(file.path) for file in self.files)

    @classmethod
    def open(cls, where: str | os.PathLike, *, variant: str | None = None) -> Checkpoint:
        """The checkpoint in folder ``where`` (``diffusion_pytorch_model*.safetensors`` or
        ``model*.safetensors``, sharded or not), or the single file ``where``."""
        where = Path(where)
        if where.is_file():
            return cls([CheckpointFile.open(where)], where)
        if not where.is_dir():
            raise CheckpointError(f"{where}: no such file or folder")
        suffix = f".{variant}.safetensors" if variant else ".safetensors"
        for stem in WEIGHT_NAMES:
            index = where / f"{stem}{suffix}.index.json"
            if index.is_file():
                return cls([CheckpointFile.open(where / name) for name in _shards(index)], where)
            single = where / f"{stem}{suffix}"
            if single.is_file():
                return cls([CheckpointFile.open(single)], where)
        others = sorted(p.name for p in where.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        hint = f" (found {', '.join(others)}: only safetensors checkpoints can be loaded into a mode)" if others else ""
        raise CheckpointError(
            f"{where}: no safetensors weights ({' or '.join(s + suffix for s in WEIGHT_NAMES)}, "
            f"or a sharded index){hint}"
        )

    def keys(self) -> list[str]:
        return list(self._by_key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def record(self, key: str) -> TensorRecord:
        return self._by_key[key].records[key]

    def records(self) -> Iterator[TensorRecord]:
        for file in self.files:
            yield from file.records.values()

    def view(self, key: str) -> torch.Tensor:
        return self._by_key[key].view(key)

    @property
    def metadata(self) -> Mapping[str, str]:
        """The first file's ``__metadata__`` (every shard carries the same for the formats memmode writes)."""
        return self.files[0].metadata if self.files else {}

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records())

    def floating_dtype(
        self, skip_modules: tuple[str, ...] = (), *, leaving_out: Collection[str] = (), widest: bool = False
    ) -> torch.dtype | None:
        """What ``torch_dtype="auto"`` loads the checkpoint in: the dtype of its floating tensors, or None when it
        holds no tensor in a dtype a model is built in. Where they are in several dtypes, either the one most of
        their bytes are in (a folder a library saved from a model in one dtype, whose stray tensors and quantization
        scales are converted to it, rather than the whole model widened), or, with ``widest``, the narrowest dtype
        that holds each of them exactly (a community file's mix, F16 tensors beside F32 norms, loads in float32:
        nothing is rounded).

        Packed tensors (float8, bytes) do not count: a quantized checkpoint's norms and biases are in the dtype it
        was saved from. Nor do tensors of the modules named in ``skip_modules`` (a model's
        ``_keep_in_fp32_modules``: float32 in any checkpoint, they say nothing of the dtype it was saved in), nor
        the tensors named in ``leaving_out`` (the parts of a single file's encoded tensors: a float32 scale is no
        norm)."""
        totals: dict[torch.dtype, int] = {}
        for record in self.records():
            if record.key in leaving_out:
                continue
            if skip_modules and any(name in record.key.split(".") for name in skip_modules):
                continue
            if record.dtype in BUILD_DTYPES:
                totals[record.dtype] = totals.get(record.dtype, 0) + record.nbytes
        if widest and totals:
            return functools.reduce(torch.promote_types, sorted(totals, key=BUILD_DTYPES.index))
        return max(totals, key=lambda d: (totals[d], BUILD_DTYPES.index(d)), default=None)

    def release(self) -> None:
        for file in self.files:
            file.release()


def _shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a readable safetensors index ({exc})") from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{index} names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not in {index.parent}"
        )
    return names
