"""The storage contract: where an offloaded group's weights wait while they are not on the device.

A :class:`Storage` is what a plugin registers; ``open`` gives a :class:`StorageSession` for one
``apply``. The engine talks to the session in group-sized units, keyed by the group's stable key:

1. ``reserve(sizes)`` before anything is released: refuse (``StorageUnavailableError``) if the
   storage cannot hold the groups — the target is still untouched.
2. ``put(key, tensors, readable)`` keeps the group's offloaded copy and returns what each tensor
   holds at rest: the copy itself, a view of it, or — for parameters only — a
   :func:`placeholder` without memory. Names in ``readable`` (the buffers, and a component's own
   loose parameters) must hold real values at rest, because pipelines read them outside any forward
   (a VAE's ``latents_mean``, ACE-Step's ``condition_encoder.null_condition_emb``). ``put``
   must not modify the tensors it is given: if a later ``put`` fails, the engine closes the
   session and the model still holds its original weights. ``put`` may leave work in flight (a file
   storage writes groups in the background, reading the tensors it was given): ``flush()`` finishes it
   or raises what failed, and the engine calls it after its puts, before it releases anything or
   fetches a group.
3. ``fetch(key, device, stream)`` returns the group's tensors on the compute device. With a
   ``stream`` the copies are issued on that stream (asynchronously where the memory allows); the
   engine makes the compute stream wait for them. Copies, allocations and page-locked memory go
   through :mod:`memmode_core.engine.streams` (``streams.active()``), never CUDA's own module, so that
   they serve every accelerator and can be checked by ``memmode_core.testing.StrictStreams``.
   ``offloaded(key, intact)`` says that the group went back to rest: the model no longer holds what
   ``fetch`` returned (unless ``intact`` is False: the model replaced some tensor with one of its own,
   which may be a view of what ``fetch`` returned). A storage that keeps something between onloads
   (``disk``'s mapping of the file) gives back its memory here.
4. ``restore(key)`` returns the tensors in ordinary CPU memory, for ``remove()``; ``read(key, name)`` one
   of them, for code that reads a resting weight's value (``state_dict()``, a parent module) when what
   ``put`` left at rest holds no value (a placeholder).
   ``check(key)`` comes before every onload and every restore: a storage whose copies can break
   behind its back (files) says so there, with a typed error, instead of handing back wrong bytes.
5. ``close()`` releases whatever the session holds (memory, files it wrote).

The :class:`Storage` itself also says what it costs (:meth:`Storage.cost`), for the planner.

Tensors are passed as ``{slot_name: tensor}`` dicts; slot names are stable within a group. They are plain
tensors: a library's tensor subclass (torchao's, quanto's quantized weights) reaches a storage as its inner tensors,
named ``<slot>:<inner>``, and the engine builds it again from what the storage hands back
(:mod:`memmode_core.engine.flattened`), so a storage never needs to know one.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from memmode_core.contracts.inner_tensors import flatten, is_wrapper
from memmode_core.contracts.options import Option, Options
from memmode_core.contracts.storage_cost import StorageCost

Tensors = dict[str, torch.Tensor]


class StorageSession:
    #: True when what ``put`` leaves at rest can break behind the session's back (views of a mapped file that
    #: another process may truncate): the engine then rests those tensors as stand-ins too, and a read of one
    #: at rest calls ``check(key)`` first, so it is a typed error instead of a SIGBUS
    at_rest_can_break: bool = False

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Check that groups of these byte sizes fit; raise ``StorageUnavailableError`` if not."""

    def put(self, key: str, tensors: Tensors, readable: frozenset[str] = frozenset()) -> Tensors:
        raise NotImplementedError

    def flush(self) -> None:
        """Finish what the ``put`` calls so far left in flight, or raise (``StorageUnavailableError`` naming
        what broke) after dropping it. Until it returns, the session may still read the tensors it was given
        and the values ``put`` returned may not hold their bytes yet."""

    def fetch(self, key: str, device: torch.device, stream: torch.Stream | None = None) -> Tensors:
        raise NotImplementedError

    def restore(self, key: str) -> Tensors:
        raise NotImplementedError

    def read(self, key: str, name: str) -> torch.Tensor:
        """The real value of one tensor of a stored group, on the CPU, for a read at rest: code reading a
        weight whose at-rest tensor is a placeholder (``state_dict()``, ``save_pretrained``, a script).
        The engine calls ``check(key)`` first and never writes into the result. The default restores the
        group and returns the one tensor; a storage that can do better (map one tensor of a file) says so."""
        return self.restore(key)[name]

    def offloaded(self, key: str, intact: bool = True) -> None:
        """The group went back to rest after a ``fetch``; ``intact``: the model holds none of what ``fetch``
        returned any more (False: it kept a tensor of its own in place of one, which may be a view of it)."""

    def check(self, key: str) -> None:
        """Raise ``StorageUnavailableError`` (naming what broke) if the group's stored copy is no longer
        intact. The engine calls it before every onload — also when ``zero_copy`` skips ``fetch`` — and
        before ``restore``; it must be cheap (a file storage stats its file)."""

    def zero_copy(self, device: torch.device) -> bool:
        """True when ``fetch(key, device)`` returns exactly the tensors ``put`` left at rest (the ``ram``
        storage on a CPU device): onloading and offloading are then bookkeeping only, and the engine
        skips the copies and the swaps."""
        return False

    def discard(self, key: str) -> None:
        """Forget a group (its weights changed and it will be put again)."""

    def close(self) -> None:
        """Release everything the session holds."""

    def stats(self) -> dict[str, int]:
        """Bytes held, by place: ``{"pageable_bytes": ..., "pinned_bytes": ..., "disk_bytes": ...}``."""
        return {}


class Storage:
    """A registered storage kind. Subclasses set ``name`` and ``description`` and implement ``open``."""

    name: str = ""
    description: str = ""
    #: an :class:`Options` dataclass, or a tuple of :class:`Option`; ``open`` receives the typed instance
    options: tuple[Option, ...] | type[Options] = ()
    #: whether ``apply(..., offload_dir=...)`` means something to this storage
    uses_offload_dir: bool = False

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        """Why this storage cannot be used (for ``device`` if given), or None when it can."""
        return None

    def cost(self, device: torch.device) -> StorageCost | None:
        """What holding and fetching offloaded weights costs on ``device`` (:mod:`memmode_core.contracts.storage_cost`).

        The planner and ``auto`` price this storage with it. Declare it when you know it (a storage
        that compresses holds fewer bytes and fetches at its decompression speed); the default, None,
        has the planner measure the storage once per process (:func:`memmode_core.planning.measuring.probe`).
        """
        return None

    def open(self, *, device: torch.device, offload_dir: str | None, options: Options) -> StorageSession:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<storage {self.name}>"


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in pageable CPU memory: itself when it already lives there, else a copy."""
    if tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu")


#: ``data_ptr`` of each live placeholder's single element -> the placeholder (see :func:`is_known_placeholder`)
_PLACEHOLDERS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """What a parameter holds while its weights are elsewhere (on disk): no memory, same metadata.

    A one-element tensor broadcast to the full shape on the CPU, so ``shape``, ``dtype`` and
    ``device`` stay truthful for code that inspects them. It holds NaN (floats) or the largest
    value (integers), so a weight used without being onloaded shows up as NaN or an index error,
    and an in-place write to it raises, instead of computing with plausible numbers. Each one is
    remembered (weakly) by the address of its element, so that a placeholder passed to a
    computation can be recognised for what it is (:func:`is_known_placeholder`).

    A wrapper subclass (a library's quantized weight) rests as itself built over placeholders of its inner tensors.
    """
    if is_wrapper(tensor):
        tree, leaves = flatten(tensor)
        return tree.rebuild({path: placeholder(leaf) for path, leaf in leaves.items()})
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        fill: float | int | bool = float("nan")
    elif tensor.dtype == torch.bool:
        fill = False
    else:
        fill = torch.iinfo(tensor.dtype).max
    held = torch.full((), fill, dtype=tensor.dtype).expand(tensor.shape)
    _PLACEHOLDERS[held.data_ptr()] = held
    return held


def is_placeholder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a :func:`placeholder` (a broadcast single element), not real data.

    A tensor of one element (or none) looks the same broadcast or not: it is a placeholder only if
    :func:`placeholder` made it (a bias of one channel, a mixing factor, a scalar parameter). A wrapper subclass is
    one when all its inner tensors are."""
    if is_wrapper(tensor):
        return all(is_placeholder(leaf) for leaf in flatten(tensor)[1].values())
    if not all(stride == 0 for stride in tensor.stride()):
        return False
    if tensor.numel() > 1:
        return True
    held = _PLACEHOLDERS.get(tensor.data_ptr()) if tensor.numel() == 1 else None
    return held is not None and held.dtype == tensor.dtype


def is_known_placeholder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds the memory of a live :func:`placeholder` (a parameter whose ``.data`` is
    one, or the placeholder itself) — not merely some broadcast tensor, such as ``t.expand(n)`` of a
    scalar in model code."""
    if not is_placeholder(tensor):
        return False
    held = _PLACEHOLDERS.get(tensor.data_ptr())
    return held is not None and held.dtype == tensor.dtype


def data_class(tensor: torch.Tensor) -> type:
    """The class of a tensor's data: a ``Parameter`` wraps another tensor class (FSDP2's ``DTensor``, a library's
    quantized tensor), which is what decides whether it can be packed, written through, or stored as bytes."""
    return type(tensor.data) if isinstance(tensor, torch.nn.Parameter) else type(tensor)


def has_own_bytes(tensor: torch.Tensor) -> bool:
    """Whether a tensor's values are the bytes of its own memory: not for a wrapper subclass (one that flattens
    into inner tensors: ``DTensor``, torchao's and quanto's quantized tensors), whose ``data_ptr`` is not where
    its values are. Only such bytes can be copied to a slab or written to a file."""
    return not hasattr(data_class(tensor), "__tensor_flatten__")
