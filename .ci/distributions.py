#!/usr/bin/env python3
"""The chain a user takes, from the built files alone: build, check, install, use; then the newest and the lowest
dependencies.

``.ci/run`` runs ``all``; the release workflow runs ``build``. Steps, each a subcommand:

- ``build OUT``: the seven distributions' sdists, and each wheel built from its sdist (so a file missing from an
  sdist fails here), into ``OUT``; ``twine check --strict`` and the metadata the ecosystem expects (license file,
  license expression, classifiers, project URLs, bounds between plugins and core, ``py.typed``, README links
  that work on the index, one version per distribution, no tests in an sdist: docs/versioning.md).
- ``install OUT VENV``: a fresh virtual environment; torch pinned to its CPU build (requirements.txt's pin),
  then the seven from a local package index made of ``OUT``'s files only, non-editable, everything else resolved
  by pip to the newest releases the configured index has. The report of that install proves each memmode
  distribution came from ``OUT``.
- ``use VENV``: from a folder outside the checkout, ``memmode list``, ``memmode run``, an ``apply`` of
  ``model_group_offload_and_qfloat4`` with ``storage="mmap"`` equal to the full load; then (``uninstall``
  alone, or last in ``all``) one plugin uninstalled, and its mode refused with the typed error that names the
  distribution to install.
- ``newest VENV``: the newest-dependencies lane: the test tools (unpinned) into VENV, then the suite's fast
  subset (:data:`FAST_SUBSET`) run against the installed wheels, ``load`` of a saved Wan 2.2 pipeline among it.
  It lists the packages whose resolved version differs from the pinned lane's (the environment this runs in,
  made from requirements*.txt): what moved, which a failure repeats.
- ``lowest OUT VENV``: the lowest-versions lane: a fresh environment made as ``install`` makes one, with diffusers
  and transformers at the lower bounds memmode-core's ``pyproject.toml`` declares (read from it) resolved together
  with the seven and the test tools, then the fast subset. ``--torch SPEC`` (default: requirements.txt's pin;
  ``lowest``: pyproject's lower bound) and ``--torch-index URL`` choose the torch, ``--python`` the environment's
  interpreter: the release workflow runs this lane with ``--torch lowest`` from PyTorch's CPU index, on every
  Python the classifiers name (this script itself needs 3.11: tomllib).
- ``select OUT RELEASE``: for the release workflow, the built files it publishes copied to ``RELEASE``: on a tag
  ``v<version>`` (``REF_TYPE``/``REF_NAME``), the distributions whose version that is; by hand, those named in
  ``CHOSEN``.
- ``all``: build, install, use, newest, uninstall, lowest, in a temporary folder.
"""

from __future__ import annotations

import argparse
import email.parser
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = [ROOT, *sorted((ROOT / "plugins").glob("memmode-*"))]
REPOSITORY = "https://github.com/memmode/memmode"
#: where each distribution writes its one version (read as text, as setuptools reads it: nothing is imported)
VERSION_SOURCES = {"memmode-core": ("memmode_core/contracts/versions.py", "CORE_VERSION")}
#: the suite's fast subset: what a newer diffusers, transformers, peft, safetensors, accelerate or pluggy can break
#: (loading into a mode, tiny real pipelines of every family, LoRA, the plugin machinery, the CLI, the storages),
#: without the long sweeps and the multi-rank lanes; MEMMODE_TEST_ROTATION=0 keeps one fifth of the rotations
FAST_SUBSET = [
    "tests/test_load_into_mode.py",
    "tests/test_tiny_pipelines.py",
    "tests/test_core_apply.py",
    "tests/test_core_plugins.py",
    "tests/test_plugin_kit.py",
    "tests/test_plugin_docs.py",
    "tests/test_diffusers_integration.py",
    "tests/test_lora.py",
    "tests/test_quant_formats.py",
    "tests/test_storage_mmap.py",
    "tests/test_storage_disk.py",
    "tests/test_cli.py",
    "tests/test_deprecated_aliases.py",
    # single files through the readers, what a dependency's release moves first: diffusers' single-file conversion
    # (the original names), its model classes' dtypes (the dtype a file loads in)
    "tests/test_default_dtype.py",
    "tests/test_gguf_iquants_load.py",
    # one device shared by handles, and the page-locked budget the pinned plugin takes from the kit (host_pins)
    "tests/test_device_sharing.py",
]
#: what the suite needs beside memmode (requirements-test.txt's test tools, and matplotlib for ``memmode run
#: --plot``), unpinned: the lane takes their newest releases too
TEST_TOOLS = ["pytest", "pytest-xdist", "peft", "accelerate", "matplotlib"]
#: the plugin ``use`` uninstalls, and the mode that needs it
UNINSTALLED = ("memmode-qfloat4", "model_group_offload_and_qfloat4")


def say(message: str) -> None:
    print(f"[distributions] {message}", flush=True)


def run(*command: str | Path, cwd: Path | None = None, env: dict | None = None, capture: bool = False):
    command = [str(part) for part in command]
    result = subprocess.run(command, cwd=cwd, env=env, text=True, capture_output=capture)
    if result.returncode != 0:
        if capture:
            sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise SystemExit(f"[distributions] failed ({result.returncode}): {' '.join(command)}")
    return result


# -- build ----------------------------------------------------------------------------------------------------


def build(out: Path) -> None:
    """Each distribution's sdist, then its wheel from that sdist, then the checks."""
    out.mkdir(parents=True, exist_ok=True)
    for folder in DISTRIBUTIONS:
        # --no-isolation: the build backend (setuptools>=77, requirements-test.txt) is the one installed here
        run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, folder, capture=True)
    files = sorted(out.glob("*.tar.gz")) + sorted(out.glob("*.whl"))
    if len(files) != 2 * len(DISTRIBUTIONS):
        raise SystemExit(f"[distributions] expected {2 * len(DISTRIBUTIONS)} files, built {[f.name for f in files]}")
    run(sys.executable, "-m", "twine", "check", "--strict", *files, capture=True)
    problems = [problem for folder in DISTRIBUTIONS for problem in check_distribution(folder, out)]
    if problems:
        raise SystemExit("[distributions] the built files are not ready to publish:\n  " + "\n  ".join(problems))
    say(f"built and checked {len(files)} files (twine check --strict, metadata, sdists): {out}")


def name_of(folder: Path) -> str:
    """The distribution's name, as its pyproject.toml gives it."""
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]


def source_version(folder: Path, name: str) -> str:
    relative, variable = VERSION_SOURCES.get(name, (f"{name.replace('-', '_')}/__init__.py", "__version__"))
    found = re.search(rf'^{variable} = "([^"]+)"$', (folder / relative).read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f'[distributions] {folder / relative} does not say {variable} = "..."')
    return found.group(1)


def check_distribution(folder: Path, out: Path) -> list[str]:
    """What is missing from one distribution's wheel and sdist, as messages (empty: ready)."""
    name = name_of(folder)
    stem = f"{name.replace('-', '_')}-{source_version(folder, name)}"
    wheel, sdist = out / f"{stem}-py3-none-any.whl", out / f"{stem}.tar.gz"
    if not wheel.is_file() or not sdist.is_file():
        return [f"{name}: no {wheel.name} and {sdist.name} (is the version written once, and read by setuptools?)"]
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.parser.Parser().parsestr(archive.read(f"{stem}.dist-info/METADATA").decode())
    package = name.replace("-", "_")
    if f"{package}/py.typed" not in names:
        problems.append(f"{wheel.name}: no {package}/py.typed")
    if f"{stem}.dist-info/licenses/LICENSE" not in names or metadata["License-File"] != "LICENSE":
        problems.append(f"{wheel.name}: the LICENSE file is not in the wheel's metadata")
    if metadata["License-Expression"] != "Apache-2.0":
        problems.append(f"{wheel.name}: License-Expression is {metadata['License-Expression']!r}")
    classifiers = metadata.get_all("Classifier") or []
    for wanted in ("Programming Language :: Python :: 3.", "Topic :: ", "Typing :: Typed"):
        if not any(c.startswith(wanted) for c in classifiers):
            problems.append(f"{wheel.name}: no classifier {wanted}...")
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL") or [])
    for label in ("Homepage", "Documentation", "Repository", "Issues", "Changelog"):
        if not urls.get(label, "").startswith(REPOSITORY):
            problems.append(f"{wheel.name}: no project URL {label}")
    if not metadata.get_all("Author") and not metadata.get_all("Author-email"):
        problems.append(f"{wheel.name}: no author")
    requires = metadata.get_all("Requires-Dist") or []
    if name != "memmode-core":
        core = [r for r in requires if r.startswith("memmode-core")]
        if not core or "<" not in core[0] or ">=" not in core[0]:
            problems.append(f"{wheel.name}: its requirement on memmode-core is {core}, not a range with a bound")
    body = metadata.get_payload()
    relative = [link for link in re.findall(r"\]\(([^)]+)\)", body) if not link.startswith(("https://", "#"))]
    if relative:
        problems.append(f"{wheel.name}: README links that break on the package index: {relative}")
    with tarfile.open(sdist) as archive:
        members = {member.name.partition("/")[2] for member in archive.getmembers()}
    for wanted in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", f"{package}/py.typed"):
        if wanted not in members:
            problems.append(f"{sdist.name}: no {wanted}")
    tests = sorted(m for m in members if m.startswith("tests/"))
    if tests:
        problems.append(f"{sdist.name}: ships part of the test suite, which runs from a clone: {tests[:3]}...")
    return problems


def select(out: Path, release: Path) -> None:
    """The files the release publishes (see the module docstring), copied from ``out`` to ``release``."""
    versions = {}
    for folder in DISTRIBUTIONS:
        name = name_of(folder)
        versions[name] = source_version(folder, name)
    if os.environ.get("REF_TYPE") == "tag":
        tag = os.environ["REF_NAME"]
        chosen = [name for name, version in versions.items() if f"v{version}" == tag]
        if not chosen:
            raise SystemExit(f"[distributions] the tag {tag} is no distribution's version: {versions}")
    else:
        chosen = os.environ.get("CHOSEN", "").split()
        unknown = sorted(set(chosen) - set(versions))
        if unknown or not chosen:
            raise SystemExit(f"[distributions] name the distributions to publish among {sorted(versions)}: {unknown}")
    release.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        stem = f"{name.replace('-', '_')}-{versions[name]}"
        for file in (out / f"{stem}.tar.gz", out / f"{stem}-py3-none-any.whl"):
            shutil.copy2(file, release / file.name)
    say(f"publishing {', '.join(f'{n} {versions[n]}' for n in chosen)}")


# -- install --------------------------------------------------------------------------------------------------


def local_index(out: Path) -> Path:
    """A PEP 503 simple index of ``out``'s files, and of nothing else."""
    index = out / "simple"
    for file in sorted(out.glob("*.whl")) + sorted(out.glob("*.tar.gz")):
        project = re.sub(r"[-_.]+", "-", file.name.split("-")[0]).lower()
        page = index / project
        page.mkdir(parents=True, exist_ok=True)
        links = page / "index.html"
        previous = links.read_text() if links.exists() else ""
        links.write_text(previous + f'<a href="{file.resolve().as_uri()}">{html.escape(file.name)}</a>\n')
    return index


def pinned(requirement: str) -> str:
    (line,) = [line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith(requirement)]
    return line.split("#")[0].strip()


def install(
    out: Path,
    venv: Path,
    *,
    torch: str | None = None,
    torch_index: str | None = None,
    also: tuple[str, ...] = (),
    interpreter: str = sys.executable,
) -> Path:
    """A fresh environment of ``interpreter`` with the seven distributions from ``out``'s index (and ``also``,
    resolved with them); its python. ``torch``: the torch requirement (requirements.txt's pin), from
    ``torch_index`` if given."""
    started = time.monotonic()
    run(interpreter, "-m", "venv", venv)
    python = venv / "bin" / "python"
    pip = [python, "-m", "pip", "--disable-pip-version-check", "install", "--quiet", "--no-compile"]
    # the CPU build, from wherever pip is configured to find it (or from torch_index)
    run(*pip, *(["--index-url", torch_index] if torch_index else []), torch or pinned("torch=="), capture=True)
    names = [name_of(folder) for folder in DISTRIBUTIONS]
    versions = [f"{n}=={source_version(f, n)}" for n, f in zip(names, DISTRIBUTIONS)]
    report = venv / "install-report.json"
    index = local_index(out)
    run(*pip, "--extra-index-url", index.as_uri(), "--report", report, *versions, *also, capture=True)
    installed = json.loads(report.read_text())["install"]
    for item in installed:
        if item["metadata"]["name"].startswith("memmode"):
            url = item["download_info"]["url"]
            if not url.startswith(out.resolve().as_uri()):
                raise SystemExit(f"[distributions] {item['metadata']['name']} came from {url}, not from {out}")
    mine = sorted(i["metadata"]["name"] for i in installed if i["metadata"]["name"].startswith("memmode"))
    if len(mine) != len(names):
        raise SystemExit(f"[distributions] installed {mine}, expected {names}")
    say(f"installed {', '.join([*versions, *also])} from {index} into {venv} ({time.monotonic() - started:.0f} s)")
    return python


# -- use ------------------------------------------------------------------------------------------------------

APPLY_QFLOAT4_MMAP = textwrap.dedent("""
    import tempfile, torch
    import memmode_core as memmode
    assert "site-packages" in memmode.__file__, memmode.__file__
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(3, 64)
    full = model()
    packed = memmode.apply(full, "model_full_load_and_qfloat4", device="cpu").report().quantization
    assert packed["module"]["packed_layers"] == 4, packed
    expected = full(x)
    offloaded = model()
    with tempfile.TemporaryDirectory() as folder:
        handle = memmode.apply(offloaded, "model_group_offload_and_qfloat4", device="cpu", storage="mmap",
                               offload_dir=folder, offload_type="leaf_level")
        got = offloaded(x)
        report = handle.report()
        assert handle.storage == "mmap" and report.bytes_transferred > 0, report
        assert report.quantization["module"]["packed_layers"] == 4, report.quantization
        assert torch.equal(got, expected), (got - expected).abs().max()
        handle.remove()
    print("apply model_group_offload_and_qfloat4 storage=mmap: equal to model_full_load_and_qfloat4")
""")

REFUSED_WHEN_UNINSTALLED = textwrap.dedent("""
    import sys, torch
    import memmode_core as memmode
    distribution, mode = sys.argv[1], sys.argv[2]
    try:
        memmode.apply(torch.nn.Linear(4, 4), mode, device="cpu")
    except memmode.PluginNotInstalledError as error:
        assert f"pip install {distribution}" in str(error), error
        print(f"{mode} without {distribution}: PluginNotInstalledError: {error}")
    else:
        raise SystemExit(f"{mode} ran without {distribution}")
""")


def use(venv: Path) -> None:
    """The installed distributions used as a user would, from outside the checkout."""
    python, memmode = venv / "bin" / "python", venv / "bin" / "memmode"
    with tempfile.TemporaryDirectory(prefix="memmode-user-") as elsewhere:
        where = Path(elsewhere)
        listed = json.loads(run(memmode, "list", "--json", cwd=where, capture=True).stdout)
        found = {(row["kind"], row["name"]): row for row in listed}
        registered = [("quantizer", "qfloat8"), ("quantizer", "qfloat4"), ("storage", "pinned"), ("reader", "gguf")]
        for kind, name in registered:
            if (kind, name) not in found:
                raise SystemExit(f"[distributions] memmode list has no {kind} {name}: {sorted(found)}")
        for kind, name in [("storage", "disk"), ("storage", "mmap"), ("placement", "model_group_offload")]:
            if not found.get((kind, name), {}).get("available"):
                raise SystemExit(
                    f"[distributions] memmode list: {kind} {name} is not available: {found.get((kind, name))}"
                )
        say(f"memmode list: {len(listed)} rows, every first-party plugin registered")
        run(memmode, "run", "--steps", "2", cwd=where, capture=True)
        say("memmode run: the main job ran")
        say(run(python, "-c", APPLY_QFLOAT4_MMAP, cwd=where, capture=True).stdout.strip())


def uninstall_one(venv: Path) -> None:
    """One plugin uninstalled: its mode is refused with the typed error that says what to install."""
    python = venv / "bin" / "python"
    distribution, mode = UNINSTALLED
    run(python, "-m", "pip", "uninstall", "--yes", "--quiet", distribution, capture=True)
    with tempfile.TemporaryDirectory(prefix="memmode-user-") as elsewhere:
        refused = run(python, "-c", REFUSED_WHEN_UNINSTALLED, distribution, mode, cwd=elsewhere, capture=True)
    say(refused.stdout.strip())


# -- the newest dependencies ----------------------------------------------------------------------------------


def moved(python: Path) -> list[str]:
    """The packages whose version in ``python``'s environment differs from the pinned lane's (this process's
    environment, made from requirements-test.txt): what moved. Local version labels (``+cpu``) do not count."""
    from importlib import metadata

    from packaging.version import Version

    def public(version: str) -> str:
        try:
            return Version(version).public
        except ValueError:
            return version

    pinned_lane = {d.metadata["Name"].lower(): d.version for d in metadata.distributions() if d.metadata["Name"]}
    listed = json.loads(run(python, "-m", "pip", "list", "--format", "json", capture=True).stdout)
    return [
        f"{row['name']} {pinned_lane[row['name'].lower()]} -> {row['version']}"
        for row in sorted(listed, key=lambda row: row["name"].lower())
        if row["name"].lower() in pinned_lane
        and public(pinned_lane[row["name"].lower()]) != public(row["version"])
        and not row["name"].lower().startswith("memmode")
    ]


def newest(venv: Path) -> None:
    """The fast subset of the suite, from the checkout's tests, against the wheels installed in ``venv``."""
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", "--no-compile", *TEST_TOOLS, capture=True)
    fast_subset(python, "newest-dependencies")


def fast_subset(python: Path, lane: str) -> None:
    """The suite's fast subset run by ``python`` against the wheels installed beside it, from outside the checkout;
    what differs from the pinned lane is said first, and again on a failure."""
    changed = moved(python)
    say("differs from the pinned lane: " + ("; ".join(changed) if changed else "nothing"))
    env = dict(
        os.environ, MEMMODE_TEST_FROM_WHEELS="1", MEMMODE_TEST_ROTATION=os.environ.get("MEMMODE_TEST_ROTATION", "0")
    )
    with tempfile.TemporaryDirectory(prefix=f"memmode-{lane}-") as elsewhere:
        # run from elsewhere, so that nothing of the checkout but tests/ is importable: memmode comes from the wheels
        result = subprocess.run(
            [
                str(python),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--rootdir",
                str(ROOT),
                "-c",
                str(ROOT / "pyproject.toml"),
                *(str(ROOT / t) for t in FAST_SUBSET),
            ],
            cwd=elsewhere,
            env=env,
        )
    if result.returncode != 0:
        raise SystemExit(
            f"[distributions] the {lane} lane failed. What differs from the pinned lane:\n  "
            + "\n  ".join(changed or ["nothing: the failure is not a dependency's"])
        )
    say(f"the {lane} lane passed")


# -- the lowest dependencies ----------------------------------------------------------------------------------

#: the libraries the lowest lane installs at memmode-core's lower bounds (the rest resolves as pip resolves it)
AT_LOWER_BOUNDS = ("diffusers", "transformers")


def lower_bounds(names: tuple[str, ...] = AT_LOWER_BOUNDS) -> list[str]:
    """``name==X`` for each of ``names``, X the ``>=`` bound memmode-core's ``pyproject.toml`` declares."""
    from packaging.requirements import Requirement

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {}
    for line in declared:
        requirement = Requirement(line)
        if requirement.name in names:
            (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            bounds[requirement.name] = f"{requirement.name}=={bound}"
    if sorted(bounds) != sorted(names):
        raise SystemExit(f"[distributions] pyproject.toml declares no >= bound for {sorted(set(names) - set(bounds))}")
    return [bounds[name] for name in names]


def lowest(
    out: Path, venv: Path, torch: str | None = None, torch_index: str | None = None, interpreter: str | None = None
) -> None:
    """The fast subset on diffusers and transformers at their lower bounds, torch as chosen (see the module
    docstring), the seven from ``out`` and the test tools resolved together, in a fresh ``venv`` of
    ``interpreter`` (this one's by default)."""
    started = time.monotonic()
    if torch == "lowest":
        (torch,) = lower_bounds(("torch",))
    also = (*lower_bounds(), *TEST_TOOLS)
    interpreter = interpreter or sys.executable
    python = install(out, venv, torch=torch, torch_index=torch_index, also=also, interpreter=interpreter)
    fast_subset(python, "lowest-versions")
    say(f"the lowest-versions lane took {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("build").add_argument("out", type=Path)
    step = sub.add_parser("select")
    step.add_argument("out", type=Path)
    step.add_argument("release", type=Path)
    step = sub.add_parser("install")
    step.add_argument("out", type=Path)
    step.add_argument("venv", type=Path)
    sub.add_parser("use").add_argument("venv", type=Path)
    sub.add_parser("uninstall").add_argument("venv", type=Path)
    sub.add_parser("newest").add_argument("venv", type=Path)
    step = sub.add_parser("lowest")
    step.add_argument("out", type=Path)
    step.add_argument("venv", type=Path)
    step.add_argument("--torch", help="the torch requirement, or lowest (default: requirements.txt's pin)")
    step.add_argument("--torch-index", help="the package index torch comes from (default: pip's configuration)")
    step.add_argument("--python", help="the interpreter of the environment (default: the one running this)")
    step = sub.add_parser("all")
    step.add_argument("--skip-newest", action="store_true", help="build, install and use only (no newest, no lowest)")
    args = parser.parse_args(argv)
    if args.step == "build":
        build(args.out)
    elif args.step == "select":
        select(args.out, args.release)
    elif args.step == "install":
        install(args.out, args.venv)
    elif args.step == "use":
        use(args.venv)
    elif args.step == "uninstall":
        uninstall_one(args.venv)
    elif args.step == "newest":
        newest(args.venv)
    elif args.step == "lowest":
        lowest(args.out, args.venv, args.torch, args.torch_index, args.python)
    else:
        with tempfile.TemporaryDirectory(prefix="memmode-distributions-") as folder:
            out, venv = Path(folder) / "dist", Path(folder) / "venv"
            started = time.monotonic()
            build(out)
            install(out, venv)
            use(venv)
            say(f"build, install and use took {time.monotonic() - started:.0f} s")
            if not args.skip_newest:
                newest(venv)
            uninstall_one(venv)
            if not args.skip_newest:
                shutil.rmtree(venv)  # its disk, before the next environment
                lowest(out, Path(folder) / "lowest")
        shutil.rmtree(ROOT / "build", ignore_errors=True)


if __name__ == "__main__":
    main()
