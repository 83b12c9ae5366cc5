"""Offloaded groups as files: what the ``disk`` and ``mmap`` storages share.

- :mod:`.format` — one safetensors file per group, named by a digest of its content, written
  atomically, verified byte for byte, mapped or read back;
- :mod:`.folder` — the offload folder: private or given, locked while files are written, leases so
  that processes sharing it never delete what another one reads, cleanup at close and at exit;
- :mod:`.store` — the storage session base classes built on the two, with ``reserve`` (room and
  writability checked before anything is released) and the ``keep_files`` option.
"""
