"""The one table of first-party plugin names core refers to.

Core defines no plugin by these names here; it only needs to know them to say which distribution to
``pip install`` for a missing one, which storage to take when none is named, and how to order storages
that price the same. Everything else refers to plugins through their registrations.
"""

from __future__ import annotations

CORE = "memmode-core"

#: ``(kind, name)`` -> the distribution that provides it
DISTRIBUTIONS: dict[tuple[str, str], str] = {
    ("quantizer", "qfloat8"): "memmode-qfloat8",
    ("quantizer", "qfloat8_preconverted"): "memmode-qfloat8",
    ("quantizer", "qfloat4"): "memmode-qfloat4",
    ("storage", "pinned"): "memmode-storage-pinned",
    ("storage", "disk"): "memmode-storage-disk",
    ("storage", "mmap"): "memmode-storage-mmap",
    ("reader", "gguf"): "memmode-gguf",
    **{
        ("placement", name): CORE
        for name in (
            "model_full_load",
            "model_cpu_offload",
            "model_group_offload",
            "sequential_cpu_offload",
            "text_encoder_offload",
            "auto",
        )
    },
    ("storage", "ram"): CORE,
    ("reader", "comfy"): CORE,
    ("reader", "bitsandbytes"): CORE,
    ("reader", "quanto"): CORE,
    ("reader", "modelopt"): CORE,
}

#: the mode ``memmode run`` uses when none is named
DEFAULT_RUN_MODE = "model_group_offload"

#: the storage of a mode that names none
DEFAULT_STORAGE = "ram"
#: ... when computing on an accelerator and this one is installed and usable (asynchronous copies)
ACCELERATOR_STORAGE = "pinned"

#: Among candidates that price the same, storages that write no files come first: writing and hashing
#: the model is a cost at ``apply`` that the per-call model does not count. Others come after these.
STORAGE_TIE_ORDER = ("ram", "pinned", "mmap", "disk")
