"""Loading straight into a mode, and saving quantized models (top layer: it ends in ``apply``).

One road per component, in the order ``load`` takes it:

- :mod:`~memmode_core.loading.components`: which models a folder holds and what each is read from, checked and
  built as skeletons (``open_components``, shared by ``load`` and ``skeleton``, what ``plan`` prices), and the
  split of ``load``'s keywords into files given for components and the placement's options;
- :mod:`~memmode_core.loading.sources`: the one declared source of a component's weights (``WeightSource``): a
  folder's checkpoint, saved quantized by memmode or not (``CheckpointWeights``), or one file;
- :mod:`~memmode_core.loading.single_file`: a component's weights given as one file (GGUF, ComfyUI fp8, the
  original checkpoint's names), read by a reader plugin or as safetensors;
- :mod:`~memmode_core.loading.quantized_folders`: a model's folder a library saved quantized (its config's
  ``quantization_config``), read by the reader of its method into the same road as one file, or refused by name;
- :mod:`~memmode_core.loading.original_keys`: which rows of a file's tensors each tensor of the model is, from
  diffusers' own single-file conversion, traced;
- :mod:`~memmode_core.loading.skeleton`: models built from config with no weight allocated;
- :mod:`~memmode_core.loading.dtypes`: which dtype each model loads in, and the keyword each library takes it by;
- :mod:`~memmode_core.loading.binding`: a source's tensors bound as views of its pages, or converted;
- :mod:`~memmode_core.loading.load`: ``load(folder, mode)`` and ``skeleton(folder)``;
- :mod:`~memmode_core.loading.save`: ``save_quantized(target, folder)``.
"""
