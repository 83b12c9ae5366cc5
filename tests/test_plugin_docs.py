"""The plugin guide's complete packages, built from docs/writing-a-plugin.md, installed and used.

The guide holds four whole third-party packages: a quantizer (memmode-qint8), a placement
(memmode-keepfirst), a storage (memmode-zram) and a reader (memmode-nf4, whose files
tests/test_guide_reader.py loads in-process). They are extracted from the page, pip-installed
into a folder of their own (the environment stays untouched) and exercised in a child process that
finds them as a user's scripts would, through their entry points. Importing torch and diffusers is
most of a child's cost, so one child runs every check (``CHECKS``) and prints one JSON report; each
test reads its part, and a check that raised shows its traceback in that test only.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import memmode_core.plugin as kit
from memmode_core.discovery.disabling import AUTOLOAD_ENV, DISABLE_ENV
from plugin_guide import GUIDE, PACKAGES, files_from_the_guide


def test_the_guide_holds_four_complete_packages():
    expected = {f"{dist}/pyproject.toml" for dist in PACKAGES}
    expected |= {f"{dist}/{package}/__init__.py" for dist, package in PACKAGES.items()}
    assert expected <= files_from_the_guide().keys()


DOCUMENTED_MEMBERS = {
    "Placement": ("name", "description", "options", "offloads", "unavailable_reason", "check", "prefetch", "layout"),
    "Storage": ("name", "description", "options", "uses_offload_dir", "unavailable_reason", "cost", "open"),
    "StorageSession": (
        "reserve",
        "put",
        "check",
        "fetch",
        "offloaded",
        "zero_copy",
        "restore",
        "discard",
        "stats",
        "close",
    ),
    "Policy": ("RESIDENT", "STREAM", "EXCLUSIVE"),
    "Resolver": ("name", "description", "options", "resolve", "budgets", "choose"),
    "PricingResolver": ("resolve", "budgets", "choose"),
}
DOCUMENTED_FIELDS = {
    "GroupSpec": ("key", "component", "owners", "entries", "exits", "policy", "prefetchable"),
    "Target": ("obj", "is_pipeline", "components"),
    "StorageCost": (
        "kind",
        "pageable_per_byte",
        "pinned_per_byte",
        "disk_per_byte",
        "fetch_bytes_per_second",
        "fetch_latency",
        "measured",
    ),
    "Option": ("name", "default", "doc", "check"),
}


def _in_code(text: str, name: str) -> bool:
    """Whether ``name`` appears as a word inside some `code span` of ``text``."""
    return re.search(rf"`[^`\n]*(?<![\w.])(\w+\.)?{re.escape(name)}\b[^`\n]*`", text) is not None


def test_the_guide_documents_every_name_a_plugin_needs():
    """Every name of the plugin kit (``memmode_core.plugin``), and the members a plugin implements or reads."""
    text = GUIDE.read_text()
    for name in kit.__all__:
        assert hasattr(kit, name), f"memmode_core.plugin.{name} is not importable"
        assert _in_code(text, name), f"{name} is not documented in {GUIDE.name}"
    for owner, members in DOCUMENTED_MEMBERS.items():
        for member in members:
            assert hasattr(getattr(kit, owner), member), f"{owner}.{member}"
            assert _in_code(text, member), f"{owner}.{member} is not documented"
    for owner, fields in DOCUMENTED_FIELDS.items():
        declared = getattr(kit, owner).__dataclass_fields__
        for name in fields:
            assert name in declared, f"{owner}.{name}"
            assert _in_code(text, name), f"{owner}.{name} is not documented"
    for key_form in ("component/path", "component/<rest>", "transformer/transformer_blocks.0-1"):
        assert key_form in text


def _build_isolation_flags() -> list[str]:
    """Build in this environment when it has the setuptools the guide's pyproject asks for (seconds
    instead of a fresh build environment per package); otherwise let pip make one."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if major >= 77 else []


@pytest.fixture(scope="module")
def installed_guide_plugins(tmp_path_factory) -> Path:
    """The guide's four packages, pip-installed into a folder of their own."""
    root = tmp_path_factory.mktemp("guide")
    for relative, body in files_from_the_guide().items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            *_build_isolation_flags(),
            "--target",
            str(site),
            *(str(root / dist) for dist in PACKAGES),
        ],
        check=True,
    )
    return site


CHECKS = r'''
import contextlib, io, json, traceback
import torch
torch.set_num_threads(1)
from torch import nn
import memmode_core as memmode
from memmode_core import Policy
from memmode_core.cli import main as memmode_main
from helpers import state_of
from tiny_pipelines import make_pipeline, run

results = {}


def check(fn):
    try:
        results[fn.__name__] = fn()
    except Exception:
        results[fn.__name__] = {"error": traceback.format_exc()}


class Blocks(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def blocks(n, dtype=torch.float32):
    torch.manual_seed(0)
    return Blocks(n).to(dtype), torch.randn(4, 1024, dtype=dtype)


def keys(handle, policy):
    return sorted(g.key for g in handle.runtime.groups if g.policy is policy)


def same_weights(pipe, fresh):
    mine, theirs = state_of(pipe), state_of(fresh)
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


@check
def listed():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = memmode_main(["list", "--json"])
    return {"status": status, "rows": json.loads(out.getvalue())}


@check
def qint8():
    reference = make_pipeline("wan22")
    memmode.apply(reference, "model_full_load_and_qint8", device="cpu")
    expected = run(reference, "wan22")
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_group_offload_and_qint8", device="cpu")
    got = run(pipe, "wan22")
    plain = run(make_pipeline("wan22"), "wan22")
    return {"same": (got - expected).abs().max().item(), "vs_plain": (got - plain).abs().max().item(),
            "summary": handle.report().quantization["transformer"]}


_PLAIN = []


def placed_flux(mode, storage):
    """A fresh Flux pipeline under ``mode`` with ``storage``, its handle, and whether its output is a plain one's."""
    if not _PLAIN:
        _PLAIN.append(run(make_pipeline("flux"), "flux"))
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage)
    return pipe, handle, torch.equal(run(pipe, "flux"), _PLAIN[0])


@check
def zram_pipelines():
    found = {}
    for mode in ("model_group_offload", "sequential_cpu_offload"):
        pipe, handle, equal = placed_flux(mode, "zram")
        modules = list(memmode.Target.of(pipe).components.values())
        found[mode] = {
            "equal": equal,
            "held": handle.report().storage_bytes["pageable_bytes"],
            "offloaded": sum(g.nbytes for g in handle.runtime.groups if g.policy is not Policy.RESIDENT),
            "parameters_at_rest_are_placeholders": all(
                memmode.is_placeholder(p) for m in modules for p in m.parameters() if p.numel() > 1),
            "buffers_at_rest_are_real": not any(memmode.is_placeholder(b) for m in modules for b in m.buffers()),
            "buffers": sum(1 for m in modules for _ in m.buffers()),
        }
        handle.remove()
        found[mode]["restored"] = same_weights(pipe, make_pipeline("flux"))
    return found


@check
def zram_cost():
    import memmode_zram

    model, x = blocks(6, torch.bfloat16)
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage="zram")
    model(x)  # the plan is for a steady-state call
    (entry,) = [e for e in memmode.plan(model, device="cpu", storage="zram")
                if e.placement == "model_group_offload" and e.options.get("offload_type") == "block_level"]
    handle.reset_stats()
    model(x)
    report = handle.report()
    # the ratio cost() declared, from its seeded sample (the same on every run). Its time per call is a
    # timing: benchmarks/plugin_storage_cost.py measures how close plan() comes to it, not the suite
    declared = memmode_zram._costs["cpu"]
    return {"predicted_held": entry.pageable_bytes, "held": report.storage_bytes["pageable_bytes"],
            "offloaded": sum(g.nbytes for g in handle.runtime.groups), "ratio": declared.pageable_per_byte,
            "predicted_moved": entry.transfer_bytes_per_call, "moved": report.bytes_transferred,
            "predicted_onloads": entry.onloads_per_call, "onloads": report.onloads}


@check
def keepfirst_module():
    found = {}
    for keep in (0, 2, 6):
        model, x = blocks(6)
        expected = model(x)
        (entry,) = [e for e in memmode.plan(model, device="cpu", storage="ram", keep_blocks=keep)
                    if e.placement == "keep_first_offload"]
        handle = memmode.apply(model, "keep_first_offload", device="cpu", keep_blocks=keep)
        first = model(x)
        handle.reset_stats()
        second = model(x)
        report = handle.report()
        found[keep] = {"resident": keys(handle, Policy.RESIDENT), "streamed": keys(handle, Policy.STREAM),
                       "equal": torch.equal(first, expected) and torch.equal(second, expected),
                       "peak": report.peak_device_bytes, "moved": report.bytes_transferred,
                       "predicted_peak": entry.peak_device_bytes, "predicted_moved": entry.transfer_bytes_per_call}
        handle.remove()
    return found


@check
def keepfirst_pipelines():
    found = {}
    for storage in ("ram", "disk"):
        pipe, handle, equal = placed_flux("keep_first_offload", storage)
        found[storage] = {"equal": equal, "resident": keys(handle, Policy.RESIDENT), "storage": handle.storage}
        handle.remove()
        found[storage]["restored"] = same_weights(pipe, make_pipeline("flux"))
    return found


@check
def keepfirst_refusals():
    layer = nn.Linear(8, 8)
    weight = layer.weight
    found = {}
    for options in ({}, {"keep_blocks": -1}):
        try:
            memmode.apply(layer, "keep_first_offload", device="cpu", **options)
            found[str(options)] = None
        except memmode.MemmodeError as exc:
            found[str(options)] = [type(exc).__name__, str(exc)]
    found["untouched"] = layer.weight is weight and not memmode.is_placeholder(layer.weight)
    return found


print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def guide_checks(installed_guide_plugins) -> dict:
    """Run ``CHECKS`` once with the guide's packages on the path and plugin discovery left on."""
    env = {k: v for k, v in os.environ.items() if k not in (AUTOLOAD_ENV, DISABLE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(installed_guide_plugins), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, cwd=Path(__file__).parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def part(checks: dict, name: str):
    result = checks[name]
    if isinstance(result, dict) and "error" in result:
        pytest.fail(f"check {name} raised:\n{result['error']}")
    return result


def test_the_guide_plugins_are_listed_with_their_distributions(guide_checks):
    listed = part(guide_checks, "listed")
    assert listed["status"] == 0
    rows = {r["name"]: r for r in listed["rows"]}
    for kind, name, distribution in [
        ("quantizer", "qint8", "memmode-qint8"),
        ("placement", "keep_first_offload", "memmode-keepfirst"),
        ("storage", "zram", "memmode-zram"),
        ("reader", "nf4", "memmode-nf4"),
    ]:
        row = rows[name]
        assert (row["kind"], row["distribution"], row["version"], row["available"], row["reason"]) == (
            kind,
            distribution,
            "1.0.0",
            True,
            None,
        )


def test_the_guide_quantizer_quantizes_under_group_offload(guide_checks):
    result = part(guide_checks, "qint8")
    assert result["same"] <= 1e-5  # group offload moves the int8 bytes and changes nothing else
    assert 0 < result["vs_plain"] < 0.1  # int8 is close to the float weights, not equal
    assert result["summary"]["quantizer"] == "qint8"


@pytest.mark.parametrize("mode", ["model_group_offload", "sequential_cpu_offload"])
def test_the_guide_storage_is_exact_and_holds_fewer_bytes(guide_checks, mode):
    result = part(guide_checks, "zram_pipelines")[mode]
    assert result["equal"]  # torch.equal with the same pipeline without memmode
    assert 0 < result["held"] < result["offloaded"]
    assert result["parameters_at_rest_are_placeholders"]
    assert result["buffers"] and result["buffers_at_rest_are_real"]  # the readable rule
    assert result["restored"]  # remove() gives every weight back, bit for bit


def test_the_planner_predicts_the_guide_storage(guide_checks):
    """What ``plan()`` predicts for the guide's storage and a real call gives: bytes moved, bytes held. Its time
    per call is a timing, not checked here (no wall-clock assertion in the suite): benchmarks/plugin_storage_cost.py
    measures it."""
    result = part(guide_checks, "zram_cost")
    assert (result["predicted_moved"], result["predicted_onloads"]) == (result["moved"], result["onloads"])
    # bytes at rest: the ratio declared from a bf16 sample, against these bf16 weights
    assert result["held"] < result["offloaded"]
    assert result["predicted_held"] == round(result["offloaded"] * result["ratio"])
    assert result["predicted_held"] == pytest.approx(result["held"], rel=0.1)


BLOCK = 1024 * 1024 * 4 + 1024 * 4  # one Linear(1024, 1024) in float32


@pytest.mark.parametrize("keep", [0, 2, 6])
def test_the_guide_placement_keeps_exactly_the_first_blocks(guide_checks, keep):
    result = part(guide_checks, "keepfirst_module")[str(keep)]
    assert result["resident"] == [f"module/blocks.{i}" for i in range(keep)]
    assert result["streamed"] == sorted(f"module/blocks.{i}" for i in range(keep, 6))
    assert result["equal"]
    assert result["peak"] == (keep + (keep < 6)) * BLOCK  # the kept blocks, and one streamed block at a time
    assert result["moved"] == (6 - keep) * BLOCK  # per call, only the streamed blocks move
    assert (result["predicted_peak"], result["predicted_moved"]) == (result["peak"], result["moved"])


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_the_guide_placement_is_exact_on_a_pipeline(guide_checks, storage):
    result = part(guide_checks, "keepfirst_pipelines")[storage]
    assert result["storage"] == storage
    assert result["equal"] and result["restored"]
    # transformers before 5.6 nests CLIP's text model one level deeper (CLIPTextModel.text_model)
    nested = Version(importlib.metadata.version("transformers")) < Version("5.6")
    clip = "text_model.encoder.layers" if nested else "encoder.layers"
    # keep_blocks=2: the first two blocks of every component's first block list
    assert result["resident"] == sorted(
        [
            f"text_encoder/{clip}.0",
            f"text_encoder/{clip}.1",
            "text_encoder_2/encoder.block.0",
            "text_encoder_2/encoder.block.1",
            "transformer/transformer_blocks.0",
            "transformer/transformer_blocks.1",
            "vae/encoder.down_blocks.0",
            "vae/encoder.down_blocks.1",
        ]
    )


def test_the_guide_placement_refuses_a_target_without_blocks(guide_checks):
    result = part(guide_checks, "keepfirst_refusals")
    kind, message = result["{}"]
    assert kind == "IncompatibleModeError" and "has none" in message and "model_cpu_offload" in message
    kind, message = result[str({"keep_blocks": -1})]
    assert kind == "InvalidOptionError" and "keep_blocks" in message
    assert result["untouched"]
