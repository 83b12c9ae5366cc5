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
    lines = capsys.readouterr().out.splitlines()
    header, rule = lines[0], lines[1]
    assert header.split()[:5] == ["kind", "name", "distribution", "version", "available"]
    starts = [header.index(column) for column in ("name", "distribution", "version", "available")]
    for line in lines[2:]:
        for start in starts:  # every column starts where its header starts
            assert line[start - 2:start] == "  " and line[start] != " ", line
    assert set(rule.replace(" ", "")) == {"-"}


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
