"""Layer 0, the contracts: what plugins implement and what every other layer shares.

Errors, options, devices, costs, the ``Storage``/``StorageSession``, ``Placement`` and ``Quantizer`` base
classes, the hook specifications, targets, the group vocabulary (``layout``: ``GroupSpec``, ``Policy``) and
the byte packing that group files use. Nothing here imports from a layer above.
"""
