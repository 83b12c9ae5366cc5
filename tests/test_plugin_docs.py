"""The plugin guide's complete package, built from docs/writing-a-plugin.md, installed and used."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "writing-a-plugin.md"
FILE_BLOCK = re.compile(r"<!-- file: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)


def files_from_the_guide() -> dict[str, str]:
    files = {m["path"]: m["body"] for m in FILE_BLOCK.finditer(GUIDE.read_text())}
    assert {"memmode-qint8/pyproject.toml", "memmode-qint8/memmode_qint8/__init__.py"} <= files.keys()
    return files


@pytest.fixture(scope="module")
def installed_guide_plugin(tmp_path_factory) -> Path:
    """The guide's package, pip-installed into a folder of its own (the environment stays untouched)."""
    root = tmp_path_factory.mktemp("guide")
    for relative, body in files_from_the_guide().items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(root / "memmode-qint8")], check=True)
    return site


def _run(site: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_guide_plugin_is_listed_with_its_distribution(installed_guide_plugin):
    out = _run(installed_guide_plugin, "from memmode_core.cli import main; main(['list', '--json'])")
    (row,) = [r for r in json.loads(out) if r["name"] == "qint8"]
    assert (row["kind"], row["distribution"], row["version"], row["available"]) == (
        "quantizer", "memmode-qint8", "1.0.0", True)


def test_the_guide_plugin_quantizes_under_group_offload(installed_guide_plugin):
    code = """
import torch, json
torch.set_num_threads(1)
import memmode_core as memmode
from tiny_pipelines import make_pipeline, run
reference = make_pipeline("wan22")
memmode.apply(reference, "model_full_load_and_qint8", device="cpu")
expected = run(reference, "wan22")
pipe = make_pipeline("wan22")
handle = memmode.apply(pipe, "model_group_offload_and_qint8", device="cpu")
got = run(pipe, "wan22")
plain = run(make_pipeline("wan22"), "wan22")
summary = handle.report().quantization["transformer"]
print(json.dumps({"same": (got - expected).abs().max().item(), "vs_plain": (got - plain).abs().max().item(),
                  "summary": summary}))
"""
    result = json.loads(_run(installed_guide_plugin, code).strip().splitlines()[-1])
    assert result["same"] <= 1e-5  # group offload moves the int8 bytes and changes nothing else
    assert 0 < result["vs_plain"] < 0.1  # int8 is close to the float weights, not equal
    assert result["summary"]["quantizer"] == "qint8"
