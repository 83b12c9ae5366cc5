"""``load``: a diffusers pipeline folder (or one model folder) straight into a mode.

``from_pretrained`` followed by ``apply`` needs the whole model in memory before memmode can move it
out: for Wan 2.2 A14B in bfloat16, ~57 GB of RAM just to start. ``load`` builds each model with no
weight allocated (:mod:`~memmode_core.loading.skeleton`), binds its tensors as views of the checkpoint's
pages (:mod:`~memmode_core.loading.binding`), converts and quantizes one layer at a time into files that
are mapped back, and then applies the mode — so what it returns is what ``apply`` on the loaded pipeline
gives (the same groups, the same report, bit-equal outputs), without the model ever being in anonymous
memory. Weights the mode keeps in CPU memory (``ram`` storage, ``model_full_load`` on the CPU) stay views
of the checkpoint's pages, exactly as ``from_pretrained`` leaves them (diffusers and transformers map
safetensors files too): the same bytes at the same alignment, so the same kernels and the same bits.

Everything is checked before anything is bound: the mode, its options, every component's config and
checkpoint headers (a truncated shard, a missing tensor, a format no installed quantizer reads). A
failure leaves nothing behind: streamed files are unlinked as soon as they are mapped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from memmode_core.applying import execute, prepare_request
from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.units import format_bytes
from memmode_core.discovery.plugins import current
from memmode_core.files import check_room, lending, source_of_mapping, staging_folder
from memmode_core.handle import Handle
from memmode_core.layer_packing import FromCheckpoint
from memmode_core.loading.binding import bind
from memmode_core.loading.components import QuantizerTargets, component_files, open_components
from memmode_core.loading.dtypes import one_dtype
from memmode_core.loading.skeleton import complete
from memmode_core.planning.request import Request
from memmode_core.quantization import packed_record

logger = logging.getLogger("memmode")


def load(
    path: str | os.PathLike,
    mode: str,
    *,
    torch_dtype: torch.dtype | str | None = "auto",
    dtype: torch.dtype | str | None = None,
    device: Any = None,
    weight_dtype: torch.dtype | None = None,
    storage: str | None = None,
    offload_dir: str | None = None,
    components: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    unplaced: Iterable[str] | None = None,
    strict: bool = False,
    reserve: Any = None,
    variant: str | None = None,
    staging_dir: str | os.PathLike | None = None,
    in_place: bool | None = None,
    config: str | os.PathLike | None = None,
    **options: Any,
) -> Handle:
    """Load the diffusers pipeline (or the single model) saved in ``path`` straight into ``mode``.

    Arguments are those of :func:`memmode_core.apply`, plus ``torch_dtype`` and ``variant`` as
    ``from_pretrained`` takes them (``torch_dtype="auto"``, the default, loads each model in its checkpoint's
    own dtype, so that nothing is converted; ``None`` is diffusers' default, float32); ``dtype`` is the same
    argument under the name diffusers now asks for (``torch_dtype`` is deprecated there; it is not here), and
    giving both is an error; ``staging_dir`` for
    the files converted weights are streamed through (default: ``offload_dir``, else the system's temporary
    folder; they are unlinked as soon as they are mapped; their room is checked before anything is written).
    Returns the :class:`Handle`; ``handle.target`` is the pipeline or model, and ``handle.report().loading``
    says what was converted, staged, kept in the checkpoint's pages and written.

    ``in_place`` decides whether the ``disk`` and ``mmap`` storages may keep a group in the checkpoint's own
    pages instead of writing it again (:mod:`memmode_core.files.borrowed`): ``None`` (default) where no bit
    of any output can change, ``True`` wherever the group lies in the checkpoint (on a CPU compute device,
    outputs may then differ in the last bits from ``from_pretrained`` + ``apply``: CPU kernels can sum in
    another order for a weight at another alignment), ``False`` never (the storage's files are independent
    of the checkpoint, e.g. one on a slow or removable disk).

    **One file for a component.** A component of the pipeline may be given as one file in place of its subfolder
    (``transformer="wan2.2_t2v_high_noise_14B_Q4_K_M.gguf"``), its config taken from the subfolder; a bare model
    file as ``path`` takes its config from ``config`` (a model folder, or its ``config.json``). The file may be a
    safetensors file (diffusers' names or the original checkpoint's) or any format an installed reader plugin
    reads (GGUF with memmode-gguf, ComfyUI fp8 scaled): what it keeps encoded rests packed under every
    placement and storage (:mod:`memmode_core.loading.single_file`).
    """
    # -- check everything: the mode and its options, configs, headers, formats ---------------------------------
    folder, files, options = component_files(Path(path), config, options)
    request = Request.build(
        mode,
        device=device,
        weight_dtype=weight_dtype,
        storage=storage,
        offload_dir=offload_dir,
        components=components,
        exclude=exclude,
        unplaced=unplaced,
        strict=strict,
        reserve=reserve,
        options=options,
    )
    if in_place not in (None, True, False):
        raise InvalidOptionError(f"in_place={in_place!r} must be None (where no bit can change), True or False")
    torch_dtype = one_dtype(torch_dtype, dtype)
    quantizer = request.quantizer.obj if request.quantizer is not None else None
    staging = staging_dir if staging_dir is not None else offload_dir
    opened = open_components(
        folder,
        files,
        torch_dtype=torch_dtype,
        variant=variant,
        plugins=current(),
        quantizing=QuantizerTargets(quantizer, request.components),
        weight_dtype=request.weight_dtype,
    )

    # -- room for the conversions, checked before anything is written ------------------------------------
    converted = [item for item in opened.loads if item.binding is not None and item.binding.convert]
    converting = sum(item.binding.staging_bytes for item in converted)
    if staging is not None:
        os.makedirs(staging, exist_ok=True)  # the storage would create offload_dir anyway
    check_room(
        staging,
        converting,
        f"converting {sum(len(item.binding.convert) for item in converted)} tensors of "
        f"{', '.join(item.name for item in converted)} to the dtype they load in (torch_dtype={torch_dtype!r}; "
        f"'auto' keeps each checkpoint's own)",
    )

    # -- bind ------------------------------------------------------------------------------------------
    for item in opened.loads:
        if item.library_loaded:
            kwargs = (
                {}
                if item.torch_dtype is None
                else {("dtype" if item.skeleton.library == "transformers" else "torch_dtype"): item.torch_dtype}
            )
            item.skeleton.module = item.cls.from_pretrained(item.folder, variant=variant, **kwargs).eval()
            continue
        bind(item.skeleton, item.weights, item.binding, staging_dir=staging)
        complete(item.skeleton, item.name)
    target = opened.assemble()
    if opened.index is None and not files:
        _say_how_to_hand_it_to_its_pipeline(folder)

    # -- the plan, executed: its layers packed while the checkpoint is read --------------------------------------
    prepared = prepare_request(target, request)
    checkpoint = FromCheckpoint(
        staging_dir=staging,
        sources={item.name: (item.weights.identity(), str(item.torch_dtype), variant) for item in opened.loads},
        in_place=in_place,
    )
    try:
        # the checkpoint's mappings and the files converted weights were streamed to are lent to file storages,
        # which store the groups lying in them by reference rather than writing them again (see
        # memmode_core.files.borrowed); execute lends the files it packs into itself
        with lending(_lent_pages(opened, in_place)):
            handle = execute(prepared, checkpoint)
    finally:
        opened.release()
    handle.loading = _summary(handle, converting, sum(len(i.binding.convert) for i in converted), staging)
    summaries = {item.name: item.weights.summary() for item in opened.loads}
    files_read = {name: summary for name, summary in summaries.items() if summary is not None}
    if files_read:
        handle.loading["files"] = files_read
    _say_what_was_done(folder, handle)
    return handle


def _lent_pages(opened, in_place: bool | None) -> list:
    """What file storages may keep groups in: the checkpoints' mapped windows and the files converted tensors were
    streamed to (none with ``in_place=False``; at any alignment with ``in_place=True``). The parts of packed layers
    are named: only their codec's decode reads them, so they are kept in place at any alignment."""
    if in_place is False:
        return []
    anywhere = in_place is True
    decoded_only = frozenset(
        getattr(module, name).data_ptr()
        for item in opened.loads
        for module in item.skeleton.module.modules()
        if (record := packed_record(module)) is not None
        for name in record.names
    )
    windows = [
        source_of_mapping(window, f.path, any_alignment=anywhere, decoded_only=decoded_only)
        for item in opened.loads
        for f in item.weights.files
        for window in f.mappings
    ]
    converted = [
        source_of_mapping(flat, None, any_alignment=anywhere)
        for item in opened.loads
        if item.binding is not None
        for flat in item.binding.streamed
    ]
    return [*windows, *converted]


def _summary(handle: Handle, converted_bytes: int, converted_tensors: int, staging) -> dict:
    """What the load did: staged bytes, for ranks of one machine what this one packed and what it found packed,
    and for file storages where the groups went (``in_place``)."""
    stats = handle.report().storage_bytes
    packed = handle.streamed
    summary = {
        "staging_dir": str(staging_folder(staging)),
        "converted_tensors": converted_tensors,
        "converted_bytes": converted_bytes,
        "quantized_bytes": packed.nbytes,
    }
    if packed.made_once is not None:
        made = packed.made_once
        summary["packed_once_by_ranks"] = {"folder": str(made.path), "made": made.made, "found": made.found}
    if "borrowed_groups" in stats:
        summary.update(
            kept_in_place_groups=stats["borrowed_groups"],
            kept_in_place_bytes=stats["borrowed_bytes"],
            written_groups=stats["written_groups"],
            written_bytes=stats["disk_bytes"],
        )
    return summary


def _say_what_was_done(folder: Path, handle: Handle) -> None:
    s = handle.loading
    for name, read in s.get("files", {}).items():
        formats = ", ".join(f"{n} {fmt}" for fmt, n in read["packed_layers"].items()) or "none"
        logger.info(
            "memmode: %s from %s (%s reader): layers resting packed: %s; %d tensors decoded at load",
            name,
            read["path"],
            read["reader"],
            formats,
            read["decoded_tensors"],
        )
    staged = (
        f"{s['converted_tensors']} tensors converted ({format_bytes(s['converted_bytes'])}) and "
        f"{format_bytes(s['quantized_bytes'])} quantized into staging files in {s['staging_dir']}"
        if s["converted_bytes"] or s["quantized_bytes"]
        else "nothing converted or staged"
    )
    groups = (
        f"; {s['kept_in_place_groups']} groups ({format_bytes(s['kept_in_place_bytes'])}) kept in the checkpoint's "
        f"pages, {s['written_groups']} groups ({format_bytes(s['written_bytes'])}) written to the {handle.storage} "
        f"storage's files"
        if "kept_in_place_groups" in s
        else ""
    )
    logger.info("memmode: loaded %s into %s: %s%s", folder, handle.mode, staged, groups)


def _say_how_to_hand_it_to_its_pipeline(folder: Path) -> None:
    """A model folder inside a pipeline folder: say which ``from_pretrained`` really uses the loaded model.

    ``DiffusionPipeline.from_pretrained(path, transformer=handle.target)`` resolves the pipeline's optional
    components against ``DiffusionPipeline`` itself (diffusers 0.42), so a component the pipeline class lists
    as optional (Wan's ``transformer`` and ``transformer_2``) passed that way is silently replaced by a fresh
    full copy; the pipeline's own class takes it.
    """
    import json

    index_file = folder.parent / "model_index.json"
    if not index_file.is_file():
        return
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        return
    if folder.name not in index:
        return
    class_name = index.get("_class_name", "DiffusionPipeline")
    import diffusers

    pipeline_class = getattr(diffusers, class_name, None)
    optional = folder.name in (getattr(pipeline_class, "_optional_components", None) or ())
    how = f"{class_name}.from_pretrained({str(folder.parent)!r}, {folder.name}=handle.target)"
    if optional:
        logger.warning(
            "memmode: %s is the %r component of a %s folder; pass it as %s: "
            "DiffusionPipeline.from_pretrained replaces an optional component passed this way with a "
            "fresh full copy, without a word",
            folder,
            folder.name,
            class_name,
            how,
        )
    else:
        logger.info(
            "memmode: %s is the %r component of a %s folder; use it with %s", folder, folder.name, class_name, how
        )


def skeleton(
    path: str | os.PathLike,
    *,
    torch_dtype: torch.dtype | str | None = "auto",
    dtype: torch.dtype | str | None = None,
    variant: str | None = None,
    config: str | os.PathLike | None = None,
    **files_given: str | os.PathLike,
):
    """The pipeline (or model) in ``path`` with every weight on the meta device, in the dtype loading would
    give it: what ``memmode.plan`` needs, from config files and checkpoint headers alone (no weight is read;
    tokenizers and schedulers are loaded, they are small). Components given as one file (and ``config``) as
    :func:`load` takes them: their layers kept encoded are packed layers of the file's sizes."""
    torch_dtype = one_dtype(torch_dtype, dtype)
    folder, files, rest = component_files(Path(path), config, files_given)
    if rest:
        raise InvalidOptionError(f"{next(iter(rest))}= names no model of the pipeline in {folder}")
    opened = open_components(folder, files, torch_dtype=torch_dtype, variant=variant, plugins=current())
    for item in opened.loads:
        if item.binding is None:
            continue
        for i, key in item.binding.source.items():
            tensor = item.binding.tensors[i]
            dtype = item.binding.convert.get(i, item.weights.record(key).dtype)
            tensor.assign(torch.empty(tensor.current.shape, dtype=dtype, device="meta"))
    return opened.assemble()
