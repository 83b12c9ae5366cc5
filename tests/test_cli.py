"""The memmode command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import memmode_core
from memmode_core.cli import main
from memmode_core.cli.parser import build_parser
from memmode_core.contracts.units import format_bytes


def tiny_demo(command: str, *argv: str) -> int:
    """``memmode <command> --size tiny <argv>``: the built-in pipeline at its smallest."""
    return main([command, "--size", "tiny", *argv])


def test_list_json_has_the_fields_of_the_brief(capsys):
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows, "nothing listed"
    for row in rows:
        assert set(row) == {"kind", "name", "distribution", "version", "available", "reason", "description"}
        assert isinstance(row["available"], bool)
    core = {(r["kind"], r["name"]) for r in rows if r["distribution"] == "memmode-core" and r["version"]}
    assert {("placement", "model_full_load"), ("placement", "model_cpu_offload"), ("storage", "ram")} <= core


def test_list_is_an_aligned_table(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    table, _, notes = out.partition("\n\n")  # why unavailable rows are unavailable comes after the table
    lines = table.splitlines()
    header, rule = lines[0], lines[1]
    assert header.split()[:5] == ["kind", "name", "distribution", "version", "available"]
    starts = [header.index(column) for column in ("name", "distribution", "version", "available")]
    for line in lines[2:]:
        for start in starts:  # every column starts where its header starts
            assert line[start - 2 : start] == "  " and line[start] != " ", line
    assert set(rule.replace(" ", "")) == {"-"}
    for line in lines[2:]:
        if " no (" in line:
            number = line.split(" no (", 1)[1].split(")", 1)[0]
            assert f"({number}) " in notes  # each unavailable row points to its reason


def test_the_console_script_runs():
    executable = shutil.which("memmode") or [sys.executable, "-m", "memmode_core"]
    command = [executable] if isinstance(executable, str) else executable
    out = subprocess.run([*command, "list", "--json"], check=True, capture_output=True, text=True).stdout
    assert any(r["name"] == "ram" for r in json.loads(out))


def test_errors_are_reported_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("MEMMODE_DISABLE_PLUGINS", "")
    import memmode_core.discovery.plugins as plugins
    from memmode_core.contracts.errors import DuplicatePluginError

    def duplicate():
        raise DuplicatePluginError("two plugins register the storage 'x'")

    monkeypatch.setattr(plugins, "current", duplicate)
    assert main(["list"]) == 2
    assert "memmode: error: two plugins register" in capsys.readouterr().err


# -- run and plan --------------------------------------------------------------------------------------


def test_run_with_no_mode_runs_the_builtin_pipeline_and_prints_its_table(capsys):
    assert tiny_demo("run", "--steps", "2", "--no-progress") == 0
    out = capsys.readouterr().out
    assert "built-in Wan 2.2-shaped pipeline" in out
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    assert ["mode", "storage", "s/call"] == header.split()[:3] and "peak on device" in header
    assert "model_group_offload" in out


def test_run_compare_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "memory.png"
    modes = ["model_full_load", "model_cpu_offload", "auto"]
    assert tiny_demo("run", "--steps", "2", "--json", "--plot", str(plot), "--compare", *modes) == 0
    data = json.loads(capsys.readouterr().out)
    results = data["results"]
    assert [r["requested"] for r in results] == ["model_full_load", "model_cpu_offload", "auto"]
    full, cpu_offload, auto = results
    assert full["bytes_transferred"] == 0 and cpu_offload["bytes_transferred"] > 0
    assert cpu_offload["peak_device_bytes"] < full["peak_device_bytes"]
    assert auto["mode"] == "model_full_load"  # no budget on a CPU device: everything fits
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_run_and_plan_a_local_diffusers_folder(tmp_path, capsys):
    from tiny_pipelines import make_pipeline

    make_pipeline("flux").save_pretrained(tmp_path / "flux")
    common = ["--model", str(tmp_path / "flux"), "--steps", "2", "--height", "16", "--width", "16"]
    assert main(["run", *common, "--json", "--mode", "sequential_cpu_offload"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["mode"] == "sequential_cpu_offload" and result["output_shape"] == [1, 3, 16, 16]
    # the call's shapes count: T5's activations at 512 tokens (12.6 MiB; 16.6 MiB with transformers before 5.15,
    # whose T5 holds one more attention-sized tensor) dwarf the weights (870 KiB)
    assert main(["plan", *common, "--vram", "1GiB", "--json"]) == 0
    activations = json.loads(capsys.readouterr().out)["entries"][0]["activation_bytes"]
    assert activations > 10 * 2**20
    # a budget with room for them and the leanest modes' weights, not for the full load's
    budget = activations + 400 * 2**10
    assert main(["plan", *common, "--vram", str(budget), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    (chosen,) = [e for e in entries if e["chosen"]]
    assert chosen["activation_bytes"] == activations
    assert chosen["peak_device_bytes"] + chosen["activation_bytes"] <= budget
    assert not next(e for e in entries if e["mode"] == "model_full_load")["fits"]


def test_run_model_loads_straight_into_the_mode_and_plan_reads_only_headers(tmp_path, capsys, monkeypatch):
    """``run --model`` goes through memmode.load (never from_pretrained); ``plan --model`` predicts from config
    files and checkpoint headers, without mapping a weight, exactly what planning the loaded pipeline gives."""
    from diffusers import DiffusionPipeline

    from memmode_core.files import checkpoint
    from tiny_pipelines import make_pipeline

    make_pipeline("wan22").save_pretrained(tmp_path / "wan")
    common = [
        "--model",
        str(tmp_path / "wan"),
        "--steps",
        "2",
        "--height",
        "16",
        "--width",
        "16",
        "--num-frames",
        "5",
        "--device",
        "cpu",
    ]
    calls, original = [], memmode_core.load
    monkeypatch.setattr(memmode_core, "load", lambda *a, **k: calls.append(a) or original(*a, **k))
    assert main(["run", *common, "--json", "--mode", "model_group_offload", "--storage", "mmap"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert calls and result["mode"] == "model_group_offload" and result["storage"] == "mmap"

    def no_mapping(self, key):
        raise AssertionError("plan --model read a weight")

    monkeypatch.setattr(checkpoint.CheckpointFile, "view", no_mapping)
    assert main(["plan", *common, "--quantizer", "qfloat8", "--json"]) == 0
    from_headers = {
        (e["mode"], e["storage"], str(e["options"])): e for e in json.loads(capsys.readouterr().out)["entries"]
    }
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "wan")
    shapes = dict(height=16, width=16, num_frames=5)
    for entry in memmode_core.plan(loaded, device="cpu", quantizer="qfloat8", steps=2, **shapes):
        got = from_headers[(entry.mode, entry.storage, str(entry.options))]
        assert (got["peak_device_bytes"], got["transfer_bytes_per_call"], got["activation_bytes"]) == (
            entry.peak_device_bytes,
            entry.transfer_bytes_per_call,
            entry.activation_bytes,
        ), entry.mode
        assert entry.activation_bytes > 0, "the call's shapes are planned for from the headers too"


def test_plan_table_marks_the_auto_choice(capsys):
    assert tiny_demo("plan", "--vram", "200KB") == 0
    out = capsys.readouterr().out
    marked = [line for line in out.splitlines() if line.startswith("*  ")]
    assert len(marked) == 1 and "yes" in marked[0]
    assert "auto would choose" in out


def test_plan_with_an_impossible_budget_says_auto_would_refuse(capsys):
    assert tiny_demo("plan", "--vram", "1KB") == 0
    assert "nothing fits" in capsys.readouterr().out


def test_plan_for_the_ranks_of_a_machine_counts_the_machines_memory(capsys):
    assert tiny_demo("plan", "--world-size", "4", "--json") == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert all(e["ranks"] == 4 for e in entries)
    ram = [e for e in entries if e["storage"] == "ram"]
    assert ram and all(e["machine_host_bytes"] == 4 * (e["pageable_bytes"] + e["pinned_bytes"]) for e in ram)
    assert tiny_demo("plan", "--world-size", "4") == 0
    assert "for 4 ranks of this machine" in capsys.readouterr().out


def test_bad_mode_is_a_clean_error(capsys):
    assert tiny_demo("run", "--mode", "model_cpu_ofload", "--no-progress") == 2
    assert "Did you mean 'model_cpu_offload'" in capsys.readouterr().err


# -- plugin options: --option NAME=VALUE ---------------------------------------------------------------


def test_option_values_are_python_literals_else_strings():
    args = build_parser().parse_args(
        [
            "run",
            "--option",
            "offload_type=leaf_level",
            "--option",
            "num_blocks_per_group=2",
            "--option",
            "keep_files=True",
            "--option",
            "use_stream=None",
            "--option",
            "ratio=0.5",
            "--option",
            "block_modules=['blocks', 'layers']",
            "--option",
            "pinned_limit=8GiB",
            "--option",
            "path=/tmp/a=b",
            "--option",
            "empty=",
        ]
    )
    assert args.option == [
        ("offload_type", "leaf_level"),
        ("num_blocks_per_group", 2),
        ("keep_files", True),
        ("use_stream", None),
        ("ratio", 0.5),
        ("block_modules", ["blocks", "layers"]),
        ("pinned_limit", "8GiB"),
        ("path", "/tmp/a=b"),
        ("empty", ""),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--option", "offload_type"], "expected NAME=VALUE"),
        (["plan", "--option", "=2"], "expected NAME=VALUE"),
        (["run", "--option", "use_stream=True", "--option", "use_stream=False"], "--option use_stream given twice"),
        (["run", "--option", "device=cpu"], "use --device"),
        (["plan", "--option", "vram_budget=8GiB"], "use --vram"),
    ],
)
def test_a_malformed_option_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"memmode {argv[0]}: error:")


def test_run_passes_options_to_apply(monkeypatch, capsys):
    seen = []
    real_apply = memmode_core.apply

    def spy(pipe, mode, **kwargs):
        seen.append(kwargs)
        return real_apply(pipe, mode, **kwargs)

    monkeypatch.setattr(memmode_core, "apply", spy)
    options = ["--option", "offload_type=leaf_level", "--option", "use_stream=False"]
    assert tiny_demo("run", "--steps", "1", "--json", "--mode", "model_group_offload", *options) == 0
    data = json.loads(capsys.readouterr().out)
    assert seen[0]["offload_type"] == "leaf_level" and seen[0]["use_stream"] is False
    assert data["options"] == {"offload_type": "leaf_level", "use_stream": False}
    assert data["results"][0]["mode"] == "model_group_offload" and data["results"][0]["refused"] is None


def test_plan_passes_placement_options_to_every_candidate_that_declares_them(capsys):
    def peaks(*options):
        assert tiny_demo("plan", "--json", *options) == 0
        entries = json.loads(capsys.readouterr().out)["entries"]
        return {(e["mode"], e["storage"], e["options"].get("offload_type")): e["peak_device_bytes"] for e in entries}

    default, two_blocks = peaks(), peaks("--option", "num_blocks_per_group=2")
    assert default.keys() == two_blocks.keys()
    for key in default:
        if key[0] == "model_group_offload" and key[2] == "block_level":  # both blocks in one group: a higher peak
            assert two_blocks[key] > default[key], key
        else:  # candidates without the option (or at leaf level, where it does not apply) are unchanged
            assert two_blocks[key] == default[key], key


@pytest.mark.parametrize("command", ["run", "plan"])
def test_an_option_no_plugin_declares_is_the_invalid_option_message(command, capsys):
    quiet = "--no-progress" if command == "run" else "--json"
    assert tiny_demo(command, "--steps", "1", quiet, "--option", "num_block_per_group=2") == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("memmode: error: unexpected option num_block_per_group")
    assert "num_blocks_per_group" in captured.err  # what is accepted
    assert "Traceback" not in captured.err and captured.out == ""


# -- what run says is on disk ---------------------------------------------------------------------------------


def files_on_disk_now(streamed_sizes: dict[int, int]) -> int:
    """Bytes of the streamed files among ``streamed_sizes`` (inode -> size) that this process still maps: unlinked
    when written, each is on disk until its last mapping goes (read from ``/proc/self/maps``, where the kernel says
    ``(deleted)`` of such a file). Only unlinked files count: the file system gives a freed inode to the next file
    made, and a group file written after a streamed file was dropped may carry its number."""
    with open("/proc/self/maps") as maps:
        lines = [line.split(maxsplit=5) for line in maps]
    inodes = {int(fields[4]) for fields in lines if len(fields) == 6 and fields[5].rstrip().endswith("(deleted)")}
    return sum(size for inode, size in streamed_sizes.items() if inode in inodes)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads which files are mapped from /proc")
@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_run_counts_on_disk_what_the_files_hold(storage, monkeypatch, capsys):
    """A quantizer packs the layers into a streamed file (unlinked at once), which the file storage keeps the
    groups in instead of writing them again (or, when it writes them, which their scales still view): that file is
    on disk as much as the group files are. The disk column is the bytes of both, as measured on the files
    themselves when the run reads its report: the group files in the session's folder, and the streamed files still
    mapped (their size taken from the open file before it was mapped). qfloat4 takes less than qfloat8."""
    from memmode_core.files import sessions, streamed

    streamed_sizes, measured = {}, []
    finish, stats = streamed.StreamedFile.finish, sessions.GroupFileSession.stats

    def measuring_finish(self):
        status = os.fstat(self._fd)
        streamed_sizes[status.st_ino] = status.st_size
        return finish(self)

    def measuring_stats(self):
        files = sum(p.stat().st_size for p in self.store.folder.glob("memmode-*.safetensors"))
        measured.append((files, files_on_disk_now(streamed_sizes)))
        return stats(self)

    monkeypatch.setattr(streamed.StreamedFile, "finish", measuring_finish)
    monkeypatch.setattr(sessions.GroupFileSession, "stats", measuring_stats)
    modes = ["model_group_offload", "model_group_offload_and_qfloat8", "model_group_offload_and_qfloat4"]
    assert tiny_demo("run", "--steps", "1", "--no-progress", "--json", "--storage", storage, "--compare", *modes) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["storage"] for r in results] == [storage] * 3 and len(measured) == 3
    assert [r["disk_bytes"] for r in results] == [files + staged for files, staged in measured]
    plain, qfloat8, qfloat4 = (r["disk_bytes"] for r in results)
    assert qfloat4 < qfloat8 < plain
    assert [r.get("staged_bytes") for r in results] == [staged for _, staged in measured]
    assert measured[0][1] == 0 and measured[1][1] > 0 and measured[2][1] > 0

    assert tiny_demo("run", "--steps", "1", "--no-progress", "--storage", storage, "--compare", *modes) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("mode"))
    assert header.split()[-1] == "disk"
    shown = [line.split("  ")[-1].strip() for line in lines[lines.index(header) + 2 :]]
    assert shown == [format_bytes(r["disk_bytes"]) for r in results]


# -- run --compare goes on past a refused mode ---------------------------------------------------------------


def test_compare_marks_a_refused_mode_in_its_row_and_goes_on(capsys):
    # model_full_load with a storage is incompatible; model_cpu_ofload is unknown; model_cpu_offload runs
    compared = ["model_full_load", "model_cpu_ofload", "model_cpu_offload"]
    assert tiny_demo("run", "--steps", "1", "--no-progress", "--storage", "ram", "--compare", *compared) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    header = next(line for line in lines if line.startswith("mode"))
    assert header.split()[-1] == "note"
    rows = {line.split()[0]: line for line in lines[lines.index(header) + 2 :]}
    assert list(rows) == ["model_full_load", "model_cpu_ofload", "model_cpu_offload"]
    assert "refused: " in rows["model_full_load"] and "storage='ram'" in rows["model_full_load"]
    assert "refused: " in rows["model_cpu_ofload"] and "'model_cpu_offload'" in rows["model_cpu_ofload"]  # did you mean
    assert "refused" not in rows["model_cpu_offload"] and " ram " in rows["model_cpu_offload"]
    assert "device cpu" in captured.out and captured.err == ""


def test_compare_json_has_the_refusal_and_exits_non_zero_when_nothing_ran(capsys):
    assert tiny_demo("run", "--steps", "1", "--json", "--compare", "model_full_load", "model_cpu_ofload") == 0
    full, typo = json.loads(capsys.readouterr().out)["results"]
    assert full["refused"] is None and full["output_shape"]
    assert typo["requested"] == "model_cpu_ofload" and typo["mode"] is None
    assert "'model_cpu_ofload'" in typo["refused"] and "\n" not in typo["refused"]

    assert tiny_demo("run", "--steps", "1", "--no-progress", "--compare", "nothing_a", "nothing_b") == 2
    captured = capsys.readouterr()
    assert captured.out.count("refused: ") == 2
    assert captured.err == "memmode: error: every mode was refused\n"


# -- a closed pipe ---------------------------------------------------------------------------------------


def test_a_closed_pipe_ends_the_output_quietly():
    """``memmode list --json | head -1`` and ``memmode list | (reader gone)``: no traceback on stderr."""
    command = [sys.executable, "-m", "memmode_core.cli", "list"]
    # the reader reads one line, then goes away (head -1)
    head_read, head_write = os.pipe()
    head = subprocess.Popen([*command, "--json"], stdout=head_write, stderr=subprocess.PIPE)
    # the reader is gone before the first byte is written: the write fails for certain
    gone_read, gone_write = os.pipe()
    os.close(gone_read)
    gone = subprocess.Popen(command, stdout=gone_write, stderr=subprocess.PIPE)
    os.close(head_write)
    os.close(gone_write)
    with os.fdopen(head_read, "rb") as reader:
        first = reader.readline()
    assert first == b"[\n"
    for child, statuses in ((head, (0, 141)), (gone, (141,))):
        _, err = child.communicate(timeout=120)
        err = err.decode()
        assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
        assert child.returncode in statuses, (child.returncode, err)


# -- the demo pipeline is public API -----------------------------------------------------------------------


def test_the_demo_pipeline_is_public_api():
    import memmode_core as memmode
    from memmode_core.demo import SIZES, demo_call, make_demo_pipeline

    assert "tiny" in SIZES
    pipe = make_demo_pipeline("tiny")
    reference = demo_call(pipe, steps=1)  # the size is read off the pipeline
    dims = SIZES["tiny"]
    assert reference.dtype == torch.float32 and reference.shape[-2:] == (dims.height, dims.width)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu")
    try:
        assert torch.equal(demo_call(pipe, steps=1), reference)  # lossless: exactly the full-load output
        assert handle.report().onloads > 0
    finally:
        handle.remove()


def test_run_auto_counts_the_call_it_makes(tmp_path, capsys):
    """``run --mode auto`` hands the call's shapes to auto (the built-in pipeline's size, or --height/--width/
    --num-frames with --model): its budget then holds weights and activations, and a refusal says both."""
    from tiny_pipelines import make_pipeline

    make_pipeline("wan22").save_pretrained(tmp_path / "wan")
    common = ["run", "--model", str(tmp_path / "wan"), "--mode", "auto", "--steps", "2", "--device", "cpu"]
    shapes = ["--height", "32", "--width", "32", "--num-frames", "5", "--no-progress"]
    assert main([*common, *shapes, "--option", "vram_budget=600KB"]) == 2
    err = capsys.readouterr().err
    assert "of weights" in err and "of activations at the call's shapes" in err
    assert main([*common, *shapes, "--option", "vram_budget=20MB", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["mode"] == "model_full_load", "20 MB hold the weights and the activations"


@pytest.mark.slow
def test_run_on_ranks_of_this_machine(capsys):
    """``--nproc 2``: the built-in pipeline on two CPU ranks, its transformers' sequence split over them."""
    assert tiny_demo("run", "--nproc", "2", "--steps", "1", "--json", "--compare", "model_group_offload", "auto") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"] == 2 and len(out["results"]) == 2
    for results in out["results"]:
        assert [r["requested"] for r in results] == ["model_group_offload", "auto"]
        assert all(r["refused"] is None and r["seconds_per_call"] > 0 for r in results)


def test_run_on_ranks_refuses_what_it_cannot_split(capsys, tmp_path):
    assert tiny_demo("run", "--nproc", "3", "--steps", "1") == 2  # the tiny transformers have 2 heads
    assert "2 attention heads cannot be shared evenly by 3 ranks" in capsys.readouterr().err
    assert main(["run", "--model", str(tmp_path), "--nproc", "2"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_run_and_plan_a_transformer_given_as_a_gguf_file(tmp_path, capsys):
    """``memmode run --transformer FILE`` (the README's community-file job) loads the built-in pipeline's configs with
    the file in the transformer's place, its blocks resting packed; ``plan`` prices it from the file's header (the
    packed bytes, not the full-precision ones) and the run moves what the plan said."""
    from memmode_core.demo import make_demo_pipeline, write_demo_gguf

    write_demo_gguf(tmp_path / "demo-Q8_0.gguf", "Q8_0", size="tiny")
    common = ["--size", "tiny", "--steps", "1", "--transformer", str(tmp_path / "demo-Q8_0.gguf"), "--json"]
    assert main(["run", *common, "--mode", "model_cpu_offload"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["mode"] == "model_cpu_offload" and result["output_shape"]

    def full_load_bytes(*argv: str) -> int:
        assert main(["plan", "--size", "tiny", "--json", *argv]) == 0
        entries = json.loads(capsys.readouterr().out)["entries"]
        return next(e for e in entries if e["mode"] == "model_full_load")["peak_device_bytes"]

    from_file = full_load_bytes("--transformer", str(tmp_path / "demo-Q8_0.gguf"))
    built_in = full_load_bytes()
    packed = sum(p.numel() for p in make_demo_pipeline("tiny").transformer.parameters() if p.dim() == 2) * 3
    assert built_in - from_file > packed // 2, "the transformer's matrices are priced packed (Q8_0: ~1/4 of float32)"
    assert main(["run", "--size", "tiny", "--transformer", str(tmp_path / "missing.gguf")]) != 0
    assert "no such file" in capsys.readouterr().err
