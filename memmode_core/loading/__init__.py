"""Loading straight into a mode, and saving quantized models (top layer: it ends in ``apply``).

- :mod:`~memmode_core.loading.skeleton`: models built from config with no weight allocated;
- :mod:`~memmode_core.loading.binding`: a checkpoint's tensors bound as views of its pages, or converted;
- :mod:`~memmode_core.loading.load`: ``load(folder, mode)``;
- :mod:`~memmode_core.loading.save`: ``save_quantized(target, folder)``.
"""
