"""The group engine: what moves together (``groups``), moving it (``runtime``: ``moving``, ``changes``,
``forwards``), the named hooks it installs (``hooks``, ``pipeline_hooks``), and its helpers (``inputs``,
``reads``, ``watch``, ``ledger``, ``staging``)."""
