"""The demo pipeline of ``memmode run``, for testing a plugin without downloading a model.

    import memmode_core as memmode
    from memmode_core.demo import make_demo_pipeline, demo_call

    pipe = make_demo_pipeline("tiny")            # Wan 2.2-shaped, random weights, built in code
    reference = demo_call(pipe, steps=1)         # frames as a float32 CPU tensor
    handle = memmode.apply(pipe, "model_group_offload_and_mine")
    assert (demo_call(pipe, steps=1) - reference).abs().max() < 0.1
    handle.remove()

See docs/getting-started.md ("Testing your plugin on the demo pipeline"). ``write_demo_gguf(path)`` writes the demo's
transformer as a GGUF file (with memmode-gguf installed), for ``memmode run --transformer path``.
"""

from __future__ import annotations

from memmode_core.cli.demo_files import write_demo_gguf
from memmode_core.cli.demo_pipeline import SIZES, DemoSize, demo_call, demo_call_kwargs, demo_size, make_demo_pipeline

__all__ = ["make_demo_pipeline", "demo_call", "demo_call_kwargs", "demo_size", "write_demo_gguf", "SIZES", "DemoSize"]
