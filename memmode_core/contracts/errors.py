"""The errors memmode raises.

Every refusal is typed, so that scripts can catch exactly what they mean to, and every one is raised
before anything on the target is touched. All of them are ``ValueError``s (through ``MemmodeError``)
because they are all "the argument you gave cannot be honoured"; the ones about argument *names or
types* are also ``TypeError``s.
"""

from __future__ import annotations


class MemmodeError(ValueError):
    """Base class of every error memmode raises on purpose."""


class UnknownModeError(MemmodeError):
    """A mode, placement, quantizer or storage name that nothing installed provides."""


class PluginNotInstalledError(UnknownModeError):
    """A first-party name whose distribution is not installed; the message says what to install."""


class PluginLoadError(UnknownModeError):
    """A name that could come from a plugin which failed to import or to register."""


class PluginKitError(PluginLoadError):
    """A plugin built for a plugin kit this memmode-core does not provide (``memmode_core.plugin.KIT_VERSION``):
    refused before any of its hooks ran. The message names the plugin, the kit it was built for (or the
    memmode-core releases it requires) and the kit and memmode-core version installed, and what to upgrade."""


class IncompatibleModeError(MemmodeError):
    """A mode that cannot be honoured on this target as it is (compiled, sharded, already quantized...)."""


class StorageUnavailableError(MemmodeError):
    """A storage that is installed but cannot work here (no CUDA for pinned memory, unwritable folder...)."""


class DuplicatePluginError(MemmodeError):
    """Two plugins register the same name within one kind."""


class InvalidOptionError(MemmodeError, TypeError):
    """An option or argument whose name is unknown or whose value is not acceptable."""


class OffloadedWeightReadError(MemmodeError, RuntimeError):
    """A computation used a weight memmode had offloaded: the model reads a submodule's weight
    outside that submodule's forward. The message names the module whose forward failed."""


class StandInReadError(OffloadedWeightReadError):
    """A read of a weight outside the forward that owns it, which memmode would serve from a stand-in (onloading
    it into the running call, reading it from the storage, dequantizing it), refused because the mode was
    applied with ``strict=True``. The message names the tensor and the code that read it."""


class OffloadedWeightWriteError(IncompatibleModeError, RuntimeError):
    """An in-place write memmode cannot carry to the weight it aims at (a view of a value served for one read,
    whose copy is temporary), refused before anything changes."""


class RestoreError(MemmodeError):
    """``remove()`` could not give back some groups (their stored copy was lost or damaged).

    Every other weight was restored and the mode is fully removed; ``failed`` maps each group key
    that was not restored to why. Those groups' tensors have no value: a read of one raises
    :class:`OffloadedWeightReadError` naming it, and a whole new value (``load_state_dict``) brings it back.
    """

    def __init__(self, failed: dict[str, str]) -> None:
        self.failed = dict(failed)
        lines = "; ".join(f"{key}: {why}" for key, why in self.failed.items())
        super().__init__(
            f"remove() restored every weight except {len(self.failed)} group(s), whose stored copy is lost and "
            f"whose tensors now have no value (reading one raises, naming it): {lines}"
        )


class QuantizedWeightWriteError(IncompatibleModeError, RuntimeError):
    """An in-place write into a quantized layer's ``weight`` stand-in, refused before it happens.

    An :class:`IncompatibleModeError`, and a ``RuntimeError`` as well: the error torch raised for such a
    write before memmode refused it (code that caught that keeps working)."""


class DeviceMemoryError(MemmodeError, RuntimeError):
    """A call of a component that does not fit on its device even with every group memmode could release released
    and its onload tried again: raised where memmode onloads, in place of the accelerator's out-of-memory error
    (chained to it), before any weight is lost (every group keeps its stored copy). ``component``, ``device``,
    ``predicted`` (the weight bytes its call was planned to hold at once), ``actual`` (those it held, with the
    group it could not onload) and ``free`` (bytes free on the device when it gave up) say the same as attributes."""

    def __init__(self, message: str, *, component: str, device: str, predicted: int, actual: int, free: int) -> None:
        super().__init__(message)
        self.component = component
        self.device = device
        self.predicted = predicted
        self.actual = actual
        self.free = free


class CheckpointError(MemmodeError):
    """A checkpoint that cannot be loaded as it is: truncated, not safetensors, missing or unexpected
    tensors, or saved in a packed format that no installed quantizer reads. The message names the file
    (and the tensor) at fault; nothing was loaded or changed."""


class ModelBuildError(CheckpointError):
    """A component's model class that its library, as installed, could not build from its config without
    weights (``load`` and ``plan`` build each model on the meta device before reading a byte of it).

    This is what a dependency's update breaks first (transformers 5.25 turned hub kernels on by default and
    refused the meta device): the message names the component, the class, the library and its version, and
    what still works. ``component``, ``library`` and ``library_version`` say the same as attributes."""

    def __init__(self, message: str, *, component: str, library: str, library_version: str) -> None:
        super().__init__(message)
        self.component = component
        self.library = library
        self.library_version = library_version


class StagingError(StorageUnavailableError):
    """The files that converted or quantized weights are streamed through while loading cannot be written.

    Either the folder has too little free space, which is refused before anything is written, or a write
    failed (disk full, file too large, I/O error), after which the partial file is already deleted. A
    :class:`StorageUnavailableError`: like an offload folder without room, this is a place that cannot
    hold the weights, and a script that catches one catches both. ``folder``, ``path`` (the file, where
    one was being written), ``needed`` and ``free`` (bytes, where known) say where and how much.
    """

    def __init__(
        self,
        message: str,
        *,
        folder: str | None = None,
        path: str | None = None,
        needed: int | None = None,
        free: int | None = None,
    ) -> None:
        super().__init__(message)
        self.folder = folder
        self.path = path
        self.needed = needed
        self.free = free
