"""Which rows of a single file's tensors each of a diffusers model's tensors is, under the original names.

Community single files (GGUF, ComfyUI fp8) keep the original checkpoint's names (Wan ``blocks.0.self_attn.q.weight``,
Flux ``double_blocks.0.img_attn.qkv.weight``), often under ``model.diffusion_model.``. diffusers knows how to rename
them: the ``checkpoint_mapping_fn`` of the model's class in ``SINGLE_FILE_LOADABLE_CLASSES``, which renames and
sometimes splits along dim 0 (Flux's fused qkv) or reorders rows (``swap_scale_shift``: chunk, then cat). memmode
keeps the file's tensors packed, so it cannot run that converter on their values. It runs it on **provenance
tensors** instead: each file tensor is replaced by one whose every element holds an id of its dim-0 row, an expanded
view costing one float per row. What comes out says, for each of the model's tensors, which rows of which file
tensors it is, in order (:class:`Renamed`); anything else the converter does to values (a transpose, arithmetic, a
reshape) is found and refused, naming the tensor, rather than guessed.

Concatenations along dim 0 of such views are done on one column and expanded again (:class:`_LazyRows`), so a trace
of Flux or Wan 14B costs a few MB whatever the converter concatenates.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memmode_core.contracts.errors import CheckpointError

#: prefixes single files put before the original names (ComfyUI: ``model.diffusion_model.``), longest first
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
#: a row's id is ``row * _STEP + _FRACTION``: arithmetic on values (a sum, a scale, a shift) leaves no valid id
_STEP = 1024.0
_FRACTION = 0.25
#: the most elements compared at once when checking that an output is constant along its trailing dims
_CHECK_CHUNK = 1 << 22
#: about how many rows are decoded at once
_DECODE_BATCH = 1 << 18


@dataclass(frozen=True)
class Rows:
    """Rows ``start:stop`` along dim 0 of the file's tensor ``key`` (a 0-d tensor: ``0:1``, the whole of it)."""

    key: str
    start: int
    stop: int


@dataclass(frozen=True)
class Renamed:
    """One of the model's tensors: ``pieces`` of the file's tensors concatenated along dim 0 make ``shape``."""

    shape: tuple[int, ...]
    pieces: tuple[Rows, ...]


@dataclass(frozen=True, eq=False)
class Renaming(Mapping[str, Renamed]):
    """The model's tensors the file holds, by the model's names (a mapping), and what did not pair up."""

    tensors: Mapping[str, Renamed]
    #: the file's tensors no tensor of the model is made of (the converter dropped them, or the model has no
    #: place for what it made of them): worth a warning
    unused: tuple[str, ...] = ()
    #: the model's tensors the file does not hold
    missing: tuple[str, ...] = ()
    #: names the converter produced that the model has no tensor for
    unexpected: tuple[str, ...] = ()
    #: the diffusers converter traced (``module.function``), or None where the file has the model's own names
    converter: str | None = None
    #: the prefix taken off the file's names (``model.diffusion_model.``), or ""
    prefix: str = ""

    def __getitem__(self, key: str) -> Renamed:
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def diffusers_names(
    model_class: type,
    config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    model_keys: Collection[str],
) -> Renaming:
    """The model's tensors the file holds, as rows of the file's tensors (``shapes``: the file's names and shapes;
    ``model_keys``: the model's state-dict names).

    A file whose names are the model's own (after a :data:`PREFIXES` prefix) is taken as it is; otherwise the
    diffusers converter for ``model_class`` (or the class it derives from) is traced with ``config`` (the model's
    diffusers config). Raises :class:`CheckpointError` when the names are neither, or the converter does to a
    tensor something other than picking rows."""
    shapes = {key: tuple(int(d) for d in shape) for key, shape in shapes.items()}
    wanted = set(model_keys)
    prefix, stripped = _strip(shapes)
    if wanted and wanted <= set(stripped):
        tensors = {key: _whole(stripped[key], shapes[stripped[key]]) for key in model_keys}
        used = set(stripped[key] for key in model_keys)
        return Renaming(tensors, unused=tuple(k for k in shapes if k not in used), prefix=prefix)
    converter, name = _converter_for(model_class, shapes, len(wanted & set(stripped)), len(wanted))
    return _trace(model_class, converter, name, dict(config), shapes, model_keys, prefix, stripped)


def _strip(shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, dict[str, str]]:
    """The file's names without a known prefix (``{name: file name}``), and the prefix most of them had."""
    counts = dict.fromkeys(PREFIXES, 0)
    names: dict[str, str] = {}
    for key in shapes:
        prefix = next((p for p in PREFIXES if key.startswith(p)), "")
        if prefix:
            counts[prefix] += 1
        names.setdefault(key[len(prefix) :], key)
    if len(names) < len(shapes):  # two file names the same once stripped: keep the names as they are
        return "", {key: key for key in shapes}
    best = max(counts, key=lambda p: counts[p])
    return (best if counts[best] else ""), names


def _whole(key: str, shape: tuple[int, ...]) -> Renamed:
    return Renamed(shape, (Rows(key, 0, shape[0] if shape else 1),))


def _converter_for(model_class: type, shapes: Mapping, present: int, total: int) -> tuple[Callable, str]:
    example = next(iter(shapes), "(none)")
    found = f"{present} of the model's {total} tensor names are in the file, e.g. it has {example!r}"
    try:
        import diffusers
        from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES as table
    except ImportError as exc:
        raise CheckpointError(
            f"the file's tensor names are not {model_class.__name__}'s ({found}), and renaming them takes "
            f"diffusers' single-file conversion, which cannot be imported ({exc}): install or repair diffusers"
        ) from exc
    entry = table.get(model_class.__name__)
    if entry is None:
        for name, entry_ in table.items():
            base = getattr(diffusers, name, None)
            if isinstance(base, type) and issubclass(model_class, base):
                entry = entry_
                break
    if entry is None or "checkpoint_mapping_fn" not in entry:
        raise CheckpointError(
            f"the file's tensor names are not {model_class.__name__}'s ({found}), and diffusers "
            f"{getattr(diffusers, '__version__', '?')} has no single-file conversion for {model_class.__name__}: "
            "use a file saved with the model's own (diffusers) names, or the model's diffusers folder"
        )
    fn = entry["checkpoint_mapping_fn"]
    return fn, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_CATS = (torch.cat, torch.concat, torch.concatenate)


class _LazyRows(TorchFunctionMode):
    """Concatenations (and copies) of tensors constant along every dim but the first, done on one column and
    expanded again: what a converter concatenates costs a float per row, not the tensor's size."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CATS and "out" not in kwargs and args and isinstance(args[0], (list, tuple)):
            tensors = list(args[0])
            dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
            if tensors and all(_row_constant(t) for t in tensors) and isinstance(dim, int):
                trailing = tensors[0].shape[1:]
                if (dim == 0 or dim == -tensors[0].dim()) and all(t.shape[1:] == trailing for t in tensors):
                    out = torch.cat([_column(t) for t in tensors], 0)
                    return out.expand(out.shape[0], *trailing)
        if func in (torch.Tensor.clone, torch.clone, torch.Tensor.contiguous) and args and _row_constant(args[0]):
            if func is torch.Tensor.contiguous or set(kwargs) <= {"memory_format"}:
                return _column(args[0]).clone().expand(args[0].shape)
        return func(*args, **kwargs)


def _row_constant(tensor: Any) -> bool:
    """A tensor of 2 dims or more that is, by its strides, one value per row."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.numel() == 0:
        return False
    return all(tensor.stride(d) == 0 or tensor.shape[d] == 1 for d in range(1, tensor.dim()))


def _column(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[(slice(None),) + (slice(0, 1),) * (tensor.dim() - 1)]


def _provenance(shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], list[str], torch.Tensor]:
    """A tensor per file tensor whose elements are their row's id, the keys in id order, and each key's first id."""
    keys = list(shapes)
    rows = [shape[0] if shape else 1 for shape in shapes.values()]
    offsets = torch.tensor([0, *rows], dtype=torch.int64).cumsum(0)
    tensors = {}
    for index, (key, shape) in enumerate(shapes.items()):
        first = int(offsets[index])
        ids = torch.arange(first, first + rows[index], dtype=torch.float64) * _STEP + _FRACTION
        if not shape:
            tensors[key] = ids.reshape(())
        elif len(shape) == 1:
            tensors[key] = ids
        else:
            tensors[key] = ids.view(-1, *([1] * (len(shape) - 1))).expand(shape)
    return tensors, keys, offsets


def _trace(
    model_class: type,
    converter: Callable,
    name: str,
    config: dict,
    shapes: dict[str, tuple[int, ...]],
    model_keys: Collection[str],
    prefix: str,
    stripped: dict[str, str],
) -> Renaming:
    cls = model_class.__name__
    wanted = set(model_keys)
    # as diffusers would call it (names as in the file), then, where that covers less, without the prefix
    attempts = [dict(zip(shapes, shapes))]
    if prefix:
        attempts.append({short: key for short, key in stripped.items()})
    best: tuple[int, dict[str, Any], list[str], torch.Tensor, dict[str, torch.Tensor]] | None = None
    failures: list[BaseException] = []
    for names in attempts:
        given, keys, offsets = _provenance(shapes)
        checkpoint = {short: given[key] for short, key in names.items()}
        try:
            with _LazyRows(), torch.no_grad():
                out = converter(checkpoint=checkpoint, config=dict(config))
        except Exception as exc:  # any failure of diffusers' converter says the names are not ones it reads
            failures.append(exc)
            continue
        if not isinstance(out, Mapping):
            failures.append(TypeError(f"it returned a {type(out).__name__}, not a state dict"))
            continue
        out = _unprefixed(out, wanted)
        covered = len(wanted & set(out))
        if best is None or covered > best[0]:
            best = (covered, out, keys, offsets, given)
        if covered == len(wanted):
            break
    if best is None:
        exc = failures[0]
        raise CheckpointError(
            f"diffusers' {name} could not convert the file's tensor names to {cls}'s "
            f"({type(exc).__name__}: {exc}); the file is not an original {cls} checkpoint that this diffusers "
            "reads: check that the file is this model's, or convert it to diffusers names"
        ) from exc
    covered, out, keys, offsets, given = best
    if not covered and wanted:
        raise CheckpointError(
            f"none of {cls}'s tensors is in the file, by its own names or by diffusers' {name} "
            f"(the file has e.g. {next(iter(shapes), '(none)')!r}, the model e.g. {next(iter(model_keys))!r}): "
            "check that the file is this model's"
        )
    # a file tensor passed on as it is (a rename) that nothing wrote to (its version counter says): no need to decode
    passed = {id(tensor): key for key, tensor in given.items() if tensor._version == 0}
    tensors, decode = {}, {}
    for key in model_keys:
        if key in out and id(out[key]) in passed:
            tensors[key] = _whole(passed[id(out[key])], shapes[passed[id(out[key])]])
        elif key in out:
            decode[key] = out[key]
    tensors |= _decode(_Refuser(cls, name), decode, keys, offsets, shapes)
    tensors = {key: tensors[key] for key in model_keys if key in tensors}
    used = {piece.key for renamed in tensors.values() for piece in renamed.pieces}
    return Renaming(
        tensors,
        unused=tuple(k for k in shapes if k not in used),
        missing=tuple(k for k in model_keys if k not in tensors),
        unexpected=tuple(k for k in out if k not in wanted),
        converter=name,
        prefix=prefix,
    )


def _unprefixed(out: Mapping[str, Any], wanted: set[str]) -> dict[str, Any]:
    """The converter's output with a known prefix taken off names the model knows only without it (a converter
    that renames inside the names and keeps the ComfyUI prefix)."""
    renamed = {}
    for key, value in out.items():
        if key not in wanted:
            prefix = next((p for p in PREFIXES if key.startswith(p) and key[len(p) :] in wanted), "")
            key = key[len(prefix) :]
        renamed.setdefault(key, value)
    return renamed


@dataclass(frozen=True)
class _Refuser:
    cls: str
    converter: str

    def __call__(self, key: str, what: str) -> CheckpointError:
        return CheckpointError(
            f"diffusers' {self.converter} {what} for {self.cls}'s {key!r}: memmode reads the file's tensors as they "
            "are stored and follows only renames and choices of rows along dim 0; load this model from a diffusers "
            "folder, or from a file saved with diffusers names"
        )


def _ids(refuse: _Refuser, key: str, value: Any) -> torch.Tensor:
    """The ids along dim 0 of a converter's output, once it is seen to be one id per row."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float64:
        what = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__} value"
        raise refuse(key, f"makes {what} (a cast or a new value)")
    shape = tuple(value.shape)
    if not shape:
        return value.reshape(1)
    if 0 in shape[1:]:
        raise refuse(key, f"makes a tensor of shape {list(shape)}, which has no row to trace")
    ids = value[(slice(None),) + (0,) * (value.dim() - 1)]
    if not all(value.stride(d) == 0 or shape[d] == 1 for d in range(1, value.dim())):
        column = ids.view(-1, *([1] * (value.dim() - 1)))
        step = max(1, _CHECK_CHUNK // max(1, value[0].numel()))
        for start in range(0, shape[0], step):
            part = value[start : start + step]
            if not torch.equal(part, column[start : start + step].expand_as(part)):
                raise refuse(key, "mixes values along a dim other than the first (a transpose or a reshape)")
    return ids


def _decode(
    refuse: _Refuser, out: dict[str, Any], keys: list[str], offsets: torch.Tensor, shapes: Mapping
) -> dict[str, Renamed]:
    """The rows of the file's tensors each output holds, decoded a batch of outputs at a time (a few tensor
    operations per batch of about :data:`_DECODE_BATCH` rows: neither one per tensor nor the whole model's)."""
    tensors: dict[str, Renamed] = {}
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for key, value in out.items():
        batch[key] = _ids(refuse, key, value)
        size += batch[key].numel()
        if size >= _DECODE_BATCH:
            tensors.update(_decode_batch(refuse, batch, out, keys, offsets, shapes))
            batch, size = {}, 0
    if batch:
        tensors.update(_decode_batch(refuse, batch, out, keys, offsets, shapes))
    return tensors


def _decode_batch(
    refuse: _Refuser, batch: dict[str, torch.Tensor], out: dict[str, Any], keys: list[str], offsets, shapes
) -> dict[str, Renamed]:
    names = list(batch)
    ids = list(batch.values())
    bounds = torch.tensor([0] + [i.numel() for i in ids], dtype=torch.int64).cumsum(0)
    rows = (torch.cat(ids) - _FRACTION) / _STEP
    whole = torch.round(rows)
    bad = ~torch.isfinite(rows) | (whole != rows) | (whole < 0) | (whole >= int(offsets[-1]))
    if bool(bad.any()):
        at = int(torch.searchsorted(bounds, torch.nonzero(bad)[0], right=True)) - 1
        raise refuse(names[at], "computes new values (arithmetic or a cast)")
    rows = whole.to(torch.int64)
    source = torch.searchsorted(offsets, rows, right=True) - 1
    local = rows - offsets[source]
    breaks = torch.ones(rows.numel(), dtype=torch.bool)
    breaks[1:] = (source[1:] != source[:-1]) | (local[1:] != local[:-1] + 1)
    breaks[bounds[:-1][bounds[:-1] < rows.numel()]] = True
    starts = torch.nonzero(breaks).flatten()
    run_key, run_first = source[starts].tolist(), local[starts].tolist()
    starts_list = starts.tolist() + [rows.numel()]
    tensors: dict[str, Renamed] = {}
    run = 0
    for index, key in enumerate(names):
        end = int(bounds[index + 1])
        pieces = []
        while run < len(run_key) and starts_list[run] < end:
            count = starts_list[run + 1] - starts_list[run]
            pieces.append(Rows(keys[run_key[run]], run_first[run], run_first[run] + count))
            run += 1
        tensors[key] = _checked(refuse, key, tuple(out[key].shape), tuple(pieces), shapes)
    return tensors


def _checked(refuse: _Refuser, key: str, shape: tuple[int, ...], pieces: tuple[Rows, ...], shapes) -> Renamed:
    """``pieces`` as the output ``key``, once their shapes are seen to make its shape."""
    for piece in pieces:
        origin = shapes[piece.key]
        if (not shape) != (not origin) or (shape and origin[1:] != shape[1:]):
            raise refuse(key, f"makes shape {list(shape)} out of {piece.key!r} of shape {list(origin)} (a reshape)")
    if not shape and len(pieces) != 1:
        raise refuse(key, "makes a 0-d tensor out of several")
    return Renamed(shape, pieces)
