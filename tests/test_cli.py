"""The memmode command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from memmode_core.cli import main


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
            assert line[start - 2:start] == "  " and line[start] != " ", line
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
    import memmode_core.plugins as plugins
    from memmode_core.errors import DuplicatePluginError

    def duplicate():
        raise DuplicatePluginError("two plugins register the storage 'x'")

    monkeypatch.setattr(plugins, "current", duplicate)
    assert main(["list"]) == 2
    assert "memmode: error: two plugins register" in capsys.readouterr().err


# -- run and plan --------------------------------------------------------------------------------------


def test_run_with_no_mode_runs_the_builtin_pipeline_and_prints_its_table(capsys):
    assert main(["run", "--size", "tiny", "--steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "built-in Wan 2.2-shaped pipeline" in out
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    assert ["mode", "storage", "s/call"] == header.split()[:3] and "peak on device" in header
    assert "model_group_offload" in out


def test_run_compare_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "memory.png"
    assert main(["run", "--size", "tiny", "--steps", "2", "--json", "--plot", str(plot),
                 "--compare", "model_full_load", "model_cpu_offload", "auto"]) == 0
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
    assert main(["plan", *common, "--vram", "300KB", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    chosen = [e for e in entries if e["chosen"]]
    assert len(chosen) == 1 and chosen[0]["peak_device_bytes"] <= 300_000


def test_plan_table_marks_the_auto_choice(capsys):
    assert main(["plan", "--size", "tiny", "--vram", "200KB"]) == 0
    out = capsys.readouterr().out
    marked = [line for line in out.splitlines() if line.startswith("*  ")]
    assert len(marked) == 1 and "yes" in marked[0]
    assert "auto would choose" in out


def test_plan_with_an_impossible_budget_says_auto_would_refuse(capsys):
    assert main(["plan", "--size", "tiny", "--vram", "1KB"]) == 0
    assert "nothing fits" in capsys.readouterr().out


def test_bad_mode_is_a_clean_error(capsys):
    assert main(["run", "--size", "tiny", "--mode", "model_cpu_ofload", "--no-progress"]) == 2
    assert "Did you mean 'model_cpu_offload'" in capsys.readouterr().err
