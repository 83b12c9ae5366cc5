"""What is particular to the ``disk`` storage: while offloaded, a parameter holds no memory and its
file is the only copy; buffers stay readable; what it reports."""

from __future__ import annotations

import torch

import memmode_core as memmode
from helpers import assert_same_outputs, module_components, nbytes
from memmode_core.files import format as group_format
from tiny_pipelines import full_load_outputs, make_pipeline, two_calls


def test_at_rest_parameters_hold_no_memory_and_buffers_keep_their_values(tmp_path):
    """At rest only what pipelines read outside any forward keeps its values in memory: the buffers (RoPE
    tables, a VAE's latent statistics) and a model's own loose parameters (Wan's ``scale_shift_table``, a
    prior's statistics, ACE-Step's null embedding, which its pipeline reads itself)."""
    pipe = make_pipeline("wan22")  # its transformers have buffers (RoPE tables)
    buffers = {(c, n): b.clone() for c, m in module_components(pipe).items() for n, b in m.named_buffers()}
    own = {
        (c, n): p.detach().clone()
        for c, m in module_components(pipe).items()
        for n, p in m.named_parameters(recurse=False)
    }
    weights = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    assert buffers and own
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path)
    for name, param in pipe.transformer.named_parameters():
        if ("transformer", name) in own:
            continue
        assert param.untyped_storage().nbytes() <= param.element_size(), f"{name} holds memory at rest"
        assert param.shape == param.data.shape and not param.is_meta
    for (component, name), value in [*buffers.items(), *own.items()]:
        module = pipe.components[component]
        held = dict(module.named_buffers()) | dict(module.named_parameters())
        assert torch.equal(held[name], value), f"{component}.{name} is not readable at rest"

    stats = handle.report().storage_bytes
    assert stats["pageable_bytes"] == nbytes([*buffers.values(), *own.values()])
    assert stats["disk_bytes"] == sum(p.stat().st_size for p in tmp_path.glob("memmode-*.safetensors"))
    assert_same_outputs(two_calls(pipe, "wan22"), full_load_outputs("wan22"))
    handle.remove()
    for name, param in pipe.transformer.named_parameters():  # back in ordinary memory, read from the files
        assert param.untyped_storage().nbytes() >= param.numel() * param.element_size(), name
        assert torch.equal(param, weights[name]), name


def test_each_onload_reads_the_file(tmp_path):
    """The file, not a copy in memory, is where the weights come from: a fetch sees the file's bytes."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    handle = memmode.apply(model, "model_cpu_offload", device="cpu", storage="disk", offload_dir=tmp_path)
    session = handle._runtime.session
    (key,) = session.files
    group_file = session.files[key]
    fetched = session.fetch(key, torch.device("cpu"))
    on_disk = group_format.read(group_file.path, group_file.layout)
    assert fetched.keys() == on_disk.keys()
    for name in fetched:
        assert torch.equal(fetched[name], on_disk[name]), name
    handle.remove()
