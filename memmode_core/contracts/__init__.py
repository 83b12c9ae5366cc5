"""Layer 0, the contracts: what plugins implement and what every other layer shares.

Errors, typed options, devices, costs, the ``Storage``/``StorageSession``, ``Placement``, ``Resolver`` and
``Quantizer`` base classes, the hook specifications, targets, the group vocabulary (``layout``:
``GroupSpec``, ``Policy``) and the byte packing that group files use. Interfaces and vocabulary only: no
measurement, no policy. Nothing here imports from a layer above.
"""
