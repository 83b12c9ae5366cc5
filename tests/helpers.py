"""What the tests share besides fixtures (those are in ``conftest.py``): the placements a sweep crosses, checks of
outputs and of weights, what memmode left on a model, signal-to-noise ratios, and which slice of a large sweep a
run takes.

**Comparing numbers.** Two rules, written once here, that hold on every CPU (an AMD EPYC with AVX-512 and an
Intel one with AVX2 run other kernels, and so does one process under ``ATEN_CPU_CAPABILITY=default`` or
``ONEDNN_MAX_CPU_ISA=AVX2``: CI runs the ``numerics`` tests under each):

- :func:`assert_bit_equal` / :func:`assert_same_outputs` only between computations of the same operands at the
  same alignment: a lossless mode against the full load of the same weights, like against like. A kernel may sum
  in another order than another CPU's, but the same kernel on the same operands sums in the same order;
- :func:`assert_reassociated` for anything else — an independent reference whose weights are the same values
  in other tensors, a weight dequantized at call time against one stored, a split attention, an adapter fused
  against one run beside: float32 sums in another order, within a tolerance derived from the computation's
  reduction length and depth and the output's magnitude (:func:`reassociation_tolerance`), never a number picked
  until a machine passed.

Imports nothing heavier than torch and memmode_core: the child processes some tests start import it too.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import pytest
import torch
from torch import nn

import memmode_core as memmode
from memmode_core import MemmodeError
from memmode_core.contracts.targets import Target
from memmode_core.engine.hooks import is_wrapped

HAS_CUDA = torch.cuda.is_available()


def requires_cuda(why: str) -> pytest.MarkDecorator:
    """For what only real CUDA shows (its allocator's counters, ``cudaHostRegister``): a visible skip without it.
    Everything else about the accelerator path runs under ``ACCELERATOR`` instead."""
    return pytest.mark.skipif(not HAS_CUDA, reason=f"needs a CUDA device: {why}")


#: the accelerator the ``accelerator``-marked tests compute on: CUDA where there is one, else the CPU, made an
#: accelerator with streams by the strict model of asynchronous copies that ``conftest.py`` installs for them
ACCELERATOR = "cuda" if HAS_CUDA else "cpu"
#: marks for a test or a parameter that runs the accelerator path (see ``ACCELERATOR``)
on_accelerator = pytest.mark.accelerator

#: every offloading placement, with the variants that lay groups out differently
OFFLOADING_PLACEMENTS = [
    ("model_cpu_offload", {}),
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("sequential_cpu_offload", {}),
    ("text_encoder_offload", {}),
]

#: every storage that runs without CUDA (``pinned`` needs it): ``poison`` is the suite's own (``fake_plugins``)
STORAGES = ["ram", "poison", "disk", "mmap"]
#: the storages that keep each offloaded group in a file
FILE_STORAGES = ["disk", "mmap"]


def placement_id(placement) -> str:
    """``model_group_offload-offload_type=leaf_level``: a test id for ``(mode, options)``."""
    mode, options = placement
    return "-".join([mode, *(f"{k}={v}" for k, v in options.items())])


# -- outputs ---------------------------------------------------------------------------------------------------


def assert_same_outputs(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    """Call by call: what :func:`assert_bit_equal` says of each (like with like: see the module docstring)."""
    for index, (g, e) in enumerate(zip(got, expected, strict=True), start=1):
        assert_bit_equal(g, e, f"call {index}")


def assert_bit_equal(got: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
    """Finite (a placeholder that reached a computation turns values into NaN) and equal bit for bit."""
    finite = torch.isfinite(got)
    assert finite.all(), f"{what}: {int((~finite).sum())} of {got.numel()} values are not finite (an offloaded weight?)"
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    assert torch.equal(got, expected), f"{what} differs from full load by {(got - expected).abs().max().item():.3g}"


#: float32's unit roundoff: one rounding moves a value by at most this much of itself
FLOAT32_ROUNDOFF = 2.0**-24
#: how many standard deviations of a reordered sum's rounding a comparison allows (the rounding errors of a long
#: sum are a random walk: its spread grows as the square root of the terms, its tail falls off like a normal's)
REASSOCIATION_MARGIN = 4


def reassociation_tolerance(expected: torch.Tensor, *, length: int, depth: int) -> float:
    """How far a float32 result may move when its sums are done in another order (another CPU's kernels, another
    alignment, a weight dequantized at call time against the same values stored).

    A sum of ``length`` terms of magnitude ``m`` rounds at each of its partial sums, each about ``sqrt(k) m``:
    its error spreads as ``FLOAT32_ROUNDOFF * sqrt(length)`` times the sum's own magnitude, and two orders differ
    by that much. ``depth`` sums in sequence on the way to the output (layers times steps) each add theirs,
    carried forward at the gain of the layers after them (about 1 in a normalized network). The magnitude is the
    output's largest: an element near zero is the cancellation of larger terms and carries their error. Allowed:
    :data:`REASSOCIATION_MARGIN` times that."""
    scale = expected.detach().abs().max().item()
    return REASSOCIATION_MARGIN * depth * length**0.5 * FLOAT32_ROUNDOFF * scale


#: how a call of one of the suite's tiny pipelines sums (``tests/tiny_*.py``): widths of 16 to 32, MLPs of 2x to 4x
#: and 3x3 convolutions over at most 32 channels, so no sum is longer than 288 terms; in sequence, a text encoder of
#: two layers (12 sums), two steps of a transformer of two blocks of about 10 sums each with its embedders (48) and
#: a VAE decoder of about a dozen convolutions: at most 72
TINY_PIPELINE_CALL = {"length": 288, "depth": 72}


def assert_reassociated(got: torch.Tensor, expected: torch.Tensor, *, length: int, depth: int, what="output") -> None:
    """Finite, and within :func:`reassociation_tolerance` of ``expected`` (computed otherwise: see the module
    docstring); ``length``: the longest sum of the computation, ``depth``: how many sums lie in sequence."""
    finite = torch.isfinite(got)
    assert finite.all(), f"{what}: {int((~finite).sum())} of {got.numel()} values are not finite"
    tolerance = reassociation_tolerance(expected, length=length, depth=depth)
    torch.testing.assert_close(
        got, expected, rtol=0, atol=tolerance, msg=lambda m: f"{what}, {length=}, {depth=}, atol {tolerance:.3g}: {m}"
    )


def nbytes(tensors) -> int:
    """How many bytes ``tensors`` hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``approximation`` against ``reference``, in dB (infinite when they are equal)."""
    reference, approximation = reference.detach().double(), approximation.detach().double()
    noise = (reference - approximation).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(reference.pow(2).sum() / noise))


# -- weights ---------------------------------------------------------------------------------------------------


def module_components(pipe) -> dict[str, nn.Module]:
    """A pipeline's components that are modules, by name."""
    return {name: component for name, component in pipe.components.items() if isinstance(component, nn.Module)}


def _named(target, tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors(module)`` of a module, or of each module of a pipeline as ``<component>.<name>``."""
    if isinstance(target, nn.Module):
        yield from tensors(target)
        return
    for component, module in module_components(target).items():
        for name, tensor in tensors(module):
            yield f"{component}.{name}", tensor


def tensors_of(target) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer of a module or pipeline, by name: non-persistent buffers (which
    ``state_dict`` leaves out) and every name of a tied weight included."""

    def tensors(module):
        return chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))

    return {name: t.detach().clone() for name, t in _named(target, tensors)}


def state_of(target) -> dict[str, torch.Tensor]:
    """A copy of the state dict of a module, or of each module of a pipeline (tensors on the meta device left out)."""
    return {
        name: t.detach().clone()
        for name, t in _named(target, lambda module: module.state_dict().items())
        if not t.is_meta
    }


def assert_same_tensors(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, nan_equal: bool = False, skip: tuple = ()
) -> None:
    """The same names, each on the CPU in its dtype and equal bit for bit, but for names starting with one of
    ``skip``. With ``nan_equal``, NaN equals NaN (a quantized layer's ``weight`` stand-in is NaN)."""
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        want = expected[name]
        assert tensor.device.type == "cpu", f"{name} is on {tensor.device}"
        assert tensor.dtype == want.dtype, f"{name} is {tensor.dtype}, was {want.dtype}"
        if name.startswith(skip):
            continue
        if nan_equal:
            same = torch.equal(tensor.isnan(), want.isnan()) and torch.equal(tensor.nan_to_num(), want.nan_to_num())
        else:
            same = torch.equal(tensor, want)
        assert same, f"{name} changed"


def in_torch_memory(target):
    """``target`` (a module or pipeline) with each parameter and buffer moved into a fresh torch allocation, its
    values unchanged, ties kept; returns ``target``. After ``from_pretrained`` the weights are views into the
    mapped checkpoint, at its offsets (the tiny Flux transformer's at 24 bytes mod 64); a weight that
    memmode stores in its files sits at a 64-byte boundary, as torch's allocations do. CPU kernels can round
    the last bits differently for operands aligned differently, so a reference that a file storage's output is
    compared with bit for bit is computed on weights in torch memory (docs/modes.md)."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:
            copy = tensor.detach().clone()
            assert copy.device.type != "cpu" or copy.data_ptr() % 64 == 0, "torch's CPU allocator aligns to 64 bytes"
            copies[id(tensor)] = (tensor, copy)
        return copies[id(tensor)][1]

    modules = [target] if isinstance(target, nn.Module) else list(module_components(target).values())
    with torch.no_grad():
        for module in (m for root in modules for m in root.modules()):
            for param in module.parameters(recurse=False):
                param.data = fresh(param)
            for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
                setattr(module, name, fresh(buffer))
    return target


def files_under(folder: Path) -> list[Path]:
    """Every file below ``folder``, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


# -- what memmode leaves on a target ---------------------------------------------------------------------------


def hook_count(target) -> int:
    """Modules whose forward memmode wraps, plus any torch forward hook memmode registered."""
    modules = [m for comp in Target.of(target).components.values() for m in comp.modules()]
    torch_hooks = sum(
        1
        for m in modules
        for hook in chain(m._forward_pre_hooks.values(), m._forward_hooks.values())
        if getattr(hook, "__module__", "").startswith("memmode_core.")
    )
    return torch_hooks + sum(1 for m in modules for method in ("forward", "encode", "decode") if is_wrapped(m, method))


def assert_refused(model: nn.Module, error: type, match: str | None = None, **apply_kwargs) -> MemmodeError:
    """``apply`` (``mode`` ``model_group_offload`` and ``device`` ``cpu`` unless given) raises ``error``, a
    ``MemmodeError``, and leaves ``model`` as it was: the same weights, no wrapper, no handle."""
    before = state_of(model)
    mode, device = apply_kwargs.pop("mode", "model_group_offload"), apply_kwargs.pop("device", "cpu")
    with pytest.raises(error, match=match) as info:
        memmode.apply(model, mode, device=device, **apply_kwargs)
    assert isinstance(info.value, MemmodeError), f"{type(info.value).__name__} is not a MemmodeError"
    assert_same_tensors(state_of(model), before)
    assert hook_count(model) == 0 and getattr(model, "_memmode_handle", None) is None
    assert memmode.remove(model) is False
    return info.value


def snapshot(target, data: bool = True) -> dict:
    """Everything apply could touch: tensor identities, data (unless ``data=False``), devices, hooks, attributes."""
    state: dict = {"<target>": getattr(target, "_memmode_handle", None)}
    for cname, comp in Target.of(target).components.items():
        for name, t in chain(comp.named_parameters(), comp.named_buffers()):
            state[(cname, name)] = (id(t), t.data_ptr() if data else None, t.device, t.dtype, tuple(t.shape))
        state[(cname, "<hooks>")] = hook_count(comp)
        state[(cname, "<attrs>")] = (
            getattr(comp, "_hf_hook", None),
            getattr(comp, "_memmode_handle", None),
            type(comp),
        )
    return state


# -- which slice of a large sweep this run takes ---------------------------------------------------------------

FULL_MATRIX_ENV = "MEMMODE_TEST_FULL_MATRIX"
ROTATION_ENV = "MEMMODE_TEST_ROTATION"
#: a sweep is cut into this many slices; a CI run runs one (a full run, all)
SLICES = 5


def full_matrix() -> bool:
    """Whether this run takes every case of every sweep (``MEMMODE_TEST_FULL_MATRIX=1``)."""
    return os.environ.get(FULL_MATRIX_ENV) == "1"


def rotation() -> int:
    """Which slice of the sweeps this run takes: ``MEMMODE_TEST_ROTATION`` if set, else derived from the commit
    checked out (so a failure reproduces on the same commit, and consecutive commits cover every slice)."""
    if os.environ.get(ROTATION_ENV, "").strip():
        return int(os.environ[ROTATION_ENV]) % SLICES
    return zlib.crc32(_head_commit().encode()) % SLICES


def in_slice(index: int, position: int) -> bool:
    """Whether this run takes the ``position``-th case of the ``index``-th family of a sweep: one case in ``SLICES``,
    offset by family, so that every family has cases in every slice (a full run takes them all)."""
    return full_matrix() or (index + position) % SLICES == rotation()


def _head_commit() -> str:
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            path = git / ref
            if path.exists():
                return path.read_text().strip()
            packed = (git / "packed-refs").read_text().splitlines()
            return next((line.split()[0] for line in packed if line.endswith(" " + ref)), ref)
        return head
    except OSError:
        return ""


def mapped_from(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s bytes in this process (``/proc/self/maps``), if any."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) == 6 else None
    return None
