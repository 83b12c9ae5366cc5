"""What is particular to the ``mmap`` storage: on the CPU the weights are views of the page cache (no
copy, no anonymous memory), a write never reaches a file, and processes that map the same files
share one copy of the weights in RAM (measured from ``/proc``)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import memmode_core as memmode
from helpers import assert_same_outputs
from tiny_pipelines import full_load_outputs, make_pipeline, two_calls


def mapped_ranges(folder: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files in ``folder``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder)):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def inside(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= tensor.data_ptr() < end for start, end in ranges)


def fetches_the_views_at_rest(session, key) -> bool:
    at_rest = session._mapped[key][1]
    fetched = session.fetch(key, torch.device("cpu"))
    return all(fetched[n].data_ptr() == at_rest[n].data_ptr() for n in at_rest)


def test_on_cpu_the_weights_are_views_of_the_mapped_files(tmp_path):
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="mmap", offload_dir=tmp_path)
    session = handle.runtime.session
    assert session.zero_copy(torch.device("cpu")) and not session.zero_copy(torch.device("cuda"))
    ranges = mapped_ranges(tmp_path)
    for component in ("transformer", "transformer_2", "text_encoder", "vae"):
        for name, tensor in [
            *pipe.components[component].named_parameters(),
            *pipe.components[component].named_buffers(),
        ]:
            assert inside(tensor, ranges), f"{component}.{name} is not a view of a mapped file"
    del tensor
    for key in session.files:  # fetch hands out the very views, not copies
        assert fetches_the_views_at_rest(session, key), key
    stats = handle.report().storage_bytes
    assert stats["mapped_bytes"] == stats["disk_bytes"] > 0 and stats["pageable_bytes"] == 0
    assert_same_outputs(two_calls(pipe, "wan22"), full_load_outputs("wan22"))

    handle.remove()  # weights back in ordinary memory, no longer tied to the (deleted) files
    assert mapped_ranges(tmp_path) == []
    assert not any(inside(p, ranges) for p in pipe.transformer.parameters())
    assert_same_outputs(two_calls(pipe, "wan22"), full_load_outputs("wan22"))


def test_a_write_to_a_weight_stays_in_the_process(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    memmode.apply(model, "model_cpu_offload", device="cpu", storage="mmap", offload_dir=tmp_path, keep_files=True)
    (path,) = tmp_path.glob("memmode-*.safetensors")
    before = load_file(path)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # copy-on-write: this process's page, never the file
    after = load_file(path)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model[0].weight, before["0.weight"] + 1.0)
    memmode.remove(model)


# -- memory, measured in separate processes ------------------------------------------------------------

_MODEL = """
import sys, torch
import memmode_core as memmode

def rss(pid="self"):
    fields = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key.startswith("Rss"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

def build():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)]).eval()  # 48 MiB

WEIGHTS = 12 * (1024 * 1024 + 1024) * 4
"""

_ANONYMOUS = _MODEL + textwrap.dedent("""
    before = rss()["RssAnon"]
    model = build()
    built = rss()["RssAnon"]
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage="mmap", offload_dir=sys.argv[1])
    with torch.inference_mode():
        for _ in range(2):
            model(torch.randn(4, 1024))
    after = rss()
    print(before, built, after["RssAnon"], after["RssFile"], WEIGHTS)
    handle.remove()
""")


def test_on_cpu_the_weights_take_no_anonymous_memory(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _ANONYMOUS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    before, built, anonymous, file_backed, weights = map(int, done.stdout.split())
    assert built - before > 0.9 * weights, "the model's own weights were anonymous memory"
    assert anonymous - before < 0.1 * weights, f"{(anonymous - before) / 2**20:.1f} MiB anonymous after computing"
    assert file_backed > weights, "the weights computed from are the mapped files"


def _build_model() -> torch.nn.Module:
    """``build()`` of ``_MODEL``, in this process: the same 48 MiB of weights."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)]).eval()


def _share(folder: str, ready, done) -> None:
    """One rank: map the model from ``folder``, touch every weight page, then hold the mapping until ``done``."""
    model = _build_model()
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage="mmap", offload_dir=folder)
    with torch.inference_mode():
        model(torch.randn(4, 1024))  # touches every weight page
    ready.set()
    done.wait(120)
    handle.remove()


def mapping_memory(pid: int, folder: Path) -> dict[str, int]:
    """Rss, Pss and shared pages (Shared_Clean + Shared_Dirty: group files are not fsync-ed, so their pages
    may not have reached the disk yet), in bytes, of a process's mappings of files in ``folder``."""
    totals = {"Rss": 0, "Pss": 0, "Shared_Clean": 0, "Shared_Dirty": 0}
    current = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:  # a mapping's header line
            current = len(fields) == 6 and fields[5].startswith(str(folder))
        elif current and fields[0].rstrip(":") in totals:
            totals[fields[0].rstrip(":")] += int(fields[1]) * 1024
    return totals


def test_two_processes_mapping_one_folder_share_one_copy(tmp_path):
    """N ranks on one node, one offload_dir: one copy of the weights in RAM, not N."""
    # Forked, not started afresh: two processes with their own mappings all the same, without the seconds
    # each new interpreter takes to import torch.
    context = multiprocessing.get_context("fork")
    done = context.Event()
    ready = [context.Event() for _ in range(2)]
    procs = [context.Process(target=_share, args=(str(tmp_path), r, done)) for r in ready]
    for p in procs:
        p.start()
    try:
        for p, r in zip(procs, ready):
            deadline = time.monotonic() + 120
            while not r.wait(0.1):
                assert p.is_alive(), (
                    f"a rank exited before it was ready (exit code {p.exitcode}; see the captured stderr)"
                )
                assert time.monotonic() < deadline, "a rank never got ready"
        weights = 12 * (1024 * 1024 + 1024) * 4
        for p in procs:
            memory = mapping_memory(p.pid, tmp_path)
            assert memory["Rss"] > 0.9 * weights, memory
            assert memory["Shared_Clean"] + memory["Shared_Dirty"] > 0.9 * memory["Rss"], memory
            assert memory["Pss"] < 0.6 * memory["Rss"], f"pages not shared: {memory}"
    finally:
        done.set()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert list(tmp_path.iterdir()) == [], "the last session deleted what the two wrote"
