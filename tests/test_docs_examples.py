"""Every fenced code block of README.md and docs/*.md, run as a new user would run it.

A page is one script: its blocks run in page order, ``python`` blocks in one namespace, so that a block
continuing an earlier one finds its names, and ``bash``/``console`` blocks through memmode's CLI in the
same process (``memmode_core.cli.main``). What a new user has and this suite has not — a model on the hub
or in ``/models``, a GPU, their own prompt or LoRA — is substituted in one place, ``Substitution`` below,
and docs/getting-started.md ("How the examples are tested") says exactly what is substituted.

A block that is not meant to run says so in the markdown: a fence info string for what is not code
(```text for layouts and output, ```console for a shell session whose ``$`` lines are commands), or an
HTML comment on the line before the fence:

- ``<!-- not-run: reason -->``: code that cannot run here (quoted from another project);
- ``<!-- accelerator: reason -->``: run by ``test_accelerator_blocks_run`` on the accelerator: CUDA where there is
  one, else the CPU under the strict model of asynchronous copies (``memmode_core.testing.StrictStreams``);
- ``<!-- signature: memmode_core.NAME -->``: a signature, compared with the real one;
- ``<!-- file: path -->``: a file of a package of the plugin guide, which tests/test_plugin_docs.py builds,
  installs and runs (not run twice here).

An unmarked block this module cannot run fails ``test_every_block_is_run_or_marked``, and every mark but
``file:`` is listed in ``MARKED``, so that adding one is a visible change of this file.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import io
import linecache
import re
import shlex
import shutil
import sys
import traceback
import types
from pathlib import Path

import pytest
import tomllib
import torch
from diffusers import DiffusionPipeline

import memmode_core
import tiny_loras
import tiny_pipelines
from helpers import on_accelerator
from memmode_core.cli import main as memmode_main
from plugin_guide import PACKAGES as GUIDE_DISTRIBUTIONS
from plugin_guide import files_from_the_guide

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CUDA = torch.cuda.is_available()

#: every HTML-comment mark other than ``file:`` (page, mark, reason): a new one is a reviewed change
MARKED = {
    ("docs/getting-started.md", "signature", "memmode_core.apply"),
    ("docs/storages.md", "accelerator", "the pinned storage is unavailable without an accelerator with streams"),
    ("docs/videox-fun.md", "not-run", "VideoX-Fun's own code, quoted; tests/test_videox_fun.py runs a copy of it"),
    ("docs/distributed.md", "not-run", "torchrun ranks on GPUs; tests/test_ranks.py runs the same on CPU ranks"),
}
RUN_LANGUAGES = {"python", "bash", "console"}
NOT_CODE_LANGUAGES = {"text"}  # a ```toml block is a file of the plugin guide, marked file:


# -- the blocks --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    mark: str | None = None  # not-run, accelerator, signature, file
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(`{3,})(.*)$")
MARK = re.compile(r"^<!-- (?P<mark>[a-z-]+): (?P<reason>.*?) -->$")


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].rstrip() != fence.group(1):
            end += 1
        assert end < len(lines), f"{page.name}:{index + 1}: a code block that is never closed"
        block = Block(page, index + 1, fence.group(2).strip().split(" ")[0], "\n".join(lines[index + 1 : end]) + "\n")
        mark = MARK.match(lines[index - 1]) if index else None
        if mark:
            block.mark, block.reason = mark["mark"], mark["reason"]
        found.append(block)
        index = end + 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]


def runnable(block: Block) -> bool:
    return block.mark is None and block.language in RUN_LANGUAGES


def test_every_block_is_run_or_marked():
    unrunnable, marks = [], set()
    for block in ALL_BLOCKS:
        if block.mark == "file":
            continue  # run by tests/test_plugin_docs.py
        if block.mark is not None:
            assert block.mark in ("not-run", "accelerator", "signature"), f"{block.name}: unknown mark {block.mark}"
            marks.add((str(block.page.relative_to(ROOT)), block.mark, block.reason))
        elif block.language not in RUN_LANGUAGES | NOT_CODE_LANGUAGES:
            unrunnable.append(f"{block.name} (```{block.language})")
    assert not unrunnable, (
        "blocks that are neither run nor marked (give them a language, ```text for what is "
        "not code, or a <!-- not-run: why --> line before the fence): " + ", ".join(unrunnable)
    )
    assert marks == MARKED, "the marked blocks changed; update MARKED after checking each mark is honest"


def test_the_plugin_guide_files_are_the_ones_test_plugin_docs_runs():
    marked = {block.reason for block in ALL_BLOCKS if block.mark == "file"}
    assert marked == set(files_from_the_guide())


def test_signature_blocks_are_the_real_signatures():
    for block in (b for b in ALL_BLOCKS if b.mark == "signature"):
        name = block.reason.removeprefix("memmode_core.")
        source = re.sub(r"^\w+\.\w+\(", "def f(", block.text.strip()) + ": ..."
        documented = ast.parse(source).body[0].args
        real = inspect.signature(getattr(memmode_core, name)).parameters.values()
        shown = [a.arg for a in documented.posonlyargs + documented.args]
        shown += [a.arg for a in documented.kwonlyargs] + ([documented.kwarg.arg] if documented.kwarg else [])
        assert shown == [p.name for p in real], f"{block.name}: the signature of {block.reason} is not the real one"
        defaults = [ast.literal_eval(d) if d is not None else inspect.Parameter.empty for d in documented.kw_defaults]
        assert defaults == [p.default for p in real if p.kind is p.KEYWORD_ONLY], block.name


# -- the substitution ------------------------------------------------------------------------------------------

#: the models the pages name, on the hub or under /models, and the tiny pipeline each one becomes
MODELS = {"Wan2.2-T2V-A14B-Diffusers": "wan22", "FLUX.1-dev": "flux"}
#: the folders the pages write to or read from, which become folders of the page's own tmp dir
FOLDERS = ("/models/", "/nvme/", "/dev/shm/")
#: what a call of a substituted pipeline is reduced to (the other arguments are the page's)
TINY_CALL = dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16)
#: a command-line flag, and what it needs installed
FLAG_NEEDS = {"--plot": "matplotlib"}


class Substitution:
    """Everything a page gets that a new user would have instead; see docs/getting-started.md."""

    def __init__(self, monkeypatch, tmp: Path, models: Path) -> None:
        self.monkeypatch, self.tmp, self.models = monkeypatch, tmp, models
        self.patched_classes: set[type] = set()
        real_from_pretrained = DiffusionPipeline.from_pretrained.__func__
        real_load = memmode_core.load

        def from_pretrained(cls, path, *args, **kwargs):
            if Path(path).is_dir():
                pipe = real_from_pretrained(cls, path, *args, **kwargs)
            else:  # a hub id: the tiny pipeline of its family, built in code, in the dtype asked for
                dtype = kwargs.get("torch_dtype") or kwargs.get("dtype") or torch.float32
                pipe = tiny_pipelines.make_pipeline(self.family(str(path)), dtype=dtype)
                assert isinstance(pipe, cls), f"{path} is a {type(pipe).__name__}, not a {cls.__name__}"
            return self.tiny(pipe)

        def load(path, mode, **kwargs):
            handle = real_load(path, mode, **kwargs)
            if hasattr(handle.target, "components"):
                self.tiny(handle.target)
            return handle

        monkeypatch.setattr(DiffusionPipeline, "from_pretrained", classmethod(from_pretrained))
        monkeypatch.setattr(memmode_core, "load", load)
        monkeypatch.chdir(tmp)  # memmode run --plot memory.png writes here

    @staticmethod
    def family(name: str) -> str:
        for model, family in MODELS.items():
            if name.endswith(model):
                return family
        raise AssertionError(f"no tiny pipeline stands in for {name}: add it to MODELS")

    def tiny(self, pipe):
        """Calls of ``pipe`` run at the tiny size (TINY_CALL) and without a progress bar."""
        pipe._docs_tiny_call = True
        pipe.set_progress_bar_config(disable=True)
        cls = type(pipe)
        if cls not in self.patched_classes:
            self.patched_classes.add(cls)
            self.monkeypatch.setattr(cls, "__call__", _tiny_call(cls.__call__))
        return pipe

    def source(self, text: str) -> str:
        """The page's code with its folders in the tmp dir and, without CUDA, the CPU for CUDA."""
        for folder in FOLDERS:
            text = re.sub(rf"(?<=[\"' ]){re.escape(folder)}", f"{self.tmp}{folder}", text)
        for model in MODELS:  # a model folder the page loads exists, as a tiny save_pretrained folder
            for match in re.finditer(rf"{re.escape(str(self.tmp))}/models/{re.escape(model)}", text):
                if not Path(match[0]).exists():
                    shutil.copytree(self.models / MODELS[model], match[0])
        for match in re.finditer(rf"{re.escape(str(self.tmp))}/models/([\w.\-]+)\.gguf", text):
            if not Path(match[0]).exists():
                community_file(Path(match[0]))
        # the demo's transformer written as a file is the tiny one, as the CLI's built-in pipeline is (cli below)
        text = re.sub(
            r"write_demo_gguf\(([^)]*)\)", lambda m: m[0] if "size=" in m[1] else m[0][:-1] + ', size="tiny")', text
        )
        if not CUDA:
            text = re.sub(r"([\"'])cuda\1", r"\1cpu\1", text)
            text = re.sub(r"(?<=[ =])cuda\b", "cpu", text)  # --device cuda
            # a line that says it needs CUDA: what it asks for is the default, streams where CUDA is
            text = re.sub(r"use_stream=True(?=.*# needs CUDA)", "use_stream=None", text)
        return text

    def namespace(self, code: str) -> dict:
        """What the page's script has before its first line: the names it uses without making them."""
        uses = set(re.findall(r"\b\w+\b", code))
        names = {"__name__": "__docs__", "torch": torch, "memmode": memmode_core}
        if {"pipe", "pipeline", "transformer"} & uses:
            names["pipe"] = self.tiny(tiny_pipelines.make_pipeline("wan22"))
            names["pipeline"] = names["pipe"]  # the VideoX-Fun scripts' name for it
            names["transformer"] = tiny_pipelines.make_pipeline("wan22", seed=1).transformer
        names["prompt"] = tiny_pipelines.PROMPT
        names.update(
            {
                name: tiny_loras.make_lora("wan22", seed=seed)
                for seed, name in enumerate(("lora_a", "lora_b"), start=1)
                if name in uses
            }
        )
        # the VideoX-Fun predict scripts' variables, and its merge_lora, which reads a LoRA file
        if "GPU_memory_mode" in uses:
            names.update(
                GPU_memory_mode="model_cpu_offload_and_qfloat8",
                device="cuda" if CUDA else "cpu",
                weight_dtype=torch.bfloat16,
            )
        if "lora_path" in uses:
            from safetensors.torch import save_file

            import videox_fun_models

            names["lora_path"] = str(self.tmp / "lora.safetensors")
            save_file(videox_fun_models.make_lora(names["pipe"].transformer, seed=3), names["lora_path"])

            def merge_lora(
                pipeline, lora_path, multiplier, device="cpu", dtype=torch.float32, sub_transformer_name="transformer"
            ):
                from safetensors.torch import load_file

                return videox_fun_models.merge_lora(
                    pipeline, load_file(lora_path), multiplier, device, dtype, sub_transformer_name
                )

            names.update(merge_lora=merge_lora, lora_weight=0.55)
        return names

    def cli(self, argv: list[str]) -> list[str]:
        """``memmode run``/``plan`` on the built-in pipeline: the tiny size and two steps, unless given."""
        if argv[:1] in (["run"], ["plan"]) and "--model" not in argv:
            argv += [] if "--size" in argv else ["--size", "tiny"]
        if argv[:1] == ["run"]:
            argv += [] if "--steps" in argv else ["--steps", "2"]
            argv += ["--no-progress"]
        return argv


def community_file(path: Path) -> None:
    """A community GGUF file a page names under /models/: the tiny Wan 2.2 pipeline's transformer (``transformer_2``
    for a file named ``low_noise``), under the original checkpoint's names, written the way city96's converter
    writes them: its matrices Q8_0, its embeddings F16 (left unquantized), its norms, biases, modulation and small
    tensors F32."""
    from gguf import GGMLQuantizationType as Q

    from gguf_files import write_gguf
    from original_checkpoints import to_original, wan_plan

    pipe = tiny_pipelines.make_pipeline("wan22")
    state = (pipe.transformer_2 if "low_noise" in path.name else pipe.transformer).state_dict()
    original = to_original(wan_plan(list(state)), state)
    tensors = {key: (value.float().numpy(), Q.Q8_0) for key, value in original.items()}
    write_gguf(path, tensors, arch="wan", keep_f32=(".modulation",), keep_f16=("embedding",))


def test_the_bare_file_example_builds_one_dtype(tmp_path, monkeypatch, tiny_models):
    """docs/community-checkpoints.md's bare model file, run as written (no torch_dtype) on a city96-style file (F16
    embeddings, F32 norms, Q8_0 matrices): every floating parameter and buffer is in one dtype, but those of the
    modules the class keeps in float32, and its first forward runs."""
    from community_pipelines import wan_inputs

    page = ROOT / "docs" / "community-checkpoints.md"
    (block,) = [b for b in blocks_of(page) if runnable(b) and "config=" in b.text and "handle.target" in b.text]
    substitution = Substitution(monkeypatch, tmp_path, tiny_models)
    namespace = substitution.namespace(block.text)
    run_python(block, substitution, namespace)
    transformer = namespace["transformer"]
    keep = tuple(type(transformer)._keep_in_fp32_modules or ())
    tensors = [*transformer.named_parameters(), *transformer.named_buffers()]
    dtypes = {t.dtype for n, t in tensors if t.is_floating_point() and not any(k in n.split(".") for k in keep)}
    assert dtypes == {torch.float32}, dtypes
    with torch.no_grad():
        out = transformer(**wan_inputs())[0]
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    namespace["handle"].remove()


def _tiny_call(call):
    parameters = inspect.signature(call).parameters

    @functools.wraps(call)
    def tiny_call(self, *args, **kwargs):
        if getattr(self, "_docs_tiny_call", False):
            kwargs.update({k: v for k, v in TINY_CALL.items() if k in parameters})
        return call(self, *args, **kwargs)

    return tiny_call


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> Path:
    """The tiny pipelines that stand in for MODELS, saved with save_pretrained."""
    root = tmp_path_factory.mktemp("models")
    for family in set(MODELS.values()):
        tiny_pipelines.make_pipeline(family).save_pretrained(root / family)
    return root


@pytest.fixture(scope="module")
def guide_site(tmp_path_factory) -> Path:
    """The plugin guide's four packages, installed as ``pip install ./memmode-...`` leaves them (their code,
    and a .dist-info folder with the entry points of their pyproject.toml), in a folder of their own."""
    site = tmp_path_factory.mktemp("guide-site")
    files = files_from_the_guide()
    for relative, body in files.items():
        _, _, inner = relative.partition("/")
        if inner == "pyproject.toml":
            project = tomllib.loads(body)["project"]
            info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
            )
            points = "".join(f"{name} = {value}\n" for name, value in project["entry-points"]["memmode"].items())
            (info / "entry_points.txt").write_text(f"[memmode]\n{points}")
        else:
            (site / inner).parent.mkdir(parents=True, exist_ok=True)
            (site / inner).write_text(body)
    return site


# -- running a page ----------------------------------------------------------------------------------------


def commands_of(block: Block, substitute=lambda line: line) -> list[list[str]]:
    """The shell commands of a block: ``&&`` chains split, comments dropped (after ``substitute`` has read the
    line); in ```console only the ``$`` lines."""
    lines = block.text.splitlines()
    if block.language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        words = shlex.split(substitute(line), comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1 :]
    return commands


def kind_of(command: list[str]) -> str:
    """What a shell command is: run through the CLI, checked, or not run (what CI itself runs)."""
    head = command[:3]
    if head[0] == "memmode":
        return "cli"
    if head[0] == "pip" or head[:3] == ["python", "-m", "pip"]:
        return "install"  # not run: CI installed requirements-test.txt; test_install_commands checks the names
    if head[0] in (".", "source") or "venv" in head or head[:3] == ["python", "-m", "pytest"]:
        return "ci"  # what CI itself ran to get here (bash .ci/run)
    if head[0] in ("python", "python3") and head[1].startswith("benchmarks/"):
        return "benchmark"  # minutes each, and not tests: the script and its flags are checked
    return "unknown"


def run_cli(substitution: Substitution, argv: list[str], where: str) -> None:
    argv = substitution.cli(argv)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = memmode_main(argv)
    assert status == 0, f"{where}: memmode {shlex.join(argv)} exited {status}:\n{err.getvalue()[-2000:]}"


def check_benchmark(command: list[str], where: str) -> None:
    script = ROOT / command[1]
    assert script.is_file(), f"{where}: {command[1]} does not exist"
    source = script.read_text()
    for flag in (word.strip("[]") for word in command[2:]):
        if flag.startswith("--"):
            assert f'"{flag}"' in source, f"{where}: {command[1]} has no {flag} option"


def run_python(block: Block, substitution: Substitution, namespace: dict) -> None:
    # Line numbers in tracebacks are the page's own: the code is compiled at its place in the page.
    filename = str(block.page)
    linecache.cache[filename] = (0, None, block.page.read_text().splitlines(True), filename)
    code = compile("\n" * block.line + substitution.source(block.text), filename, "exec")
    # as a script the page runs as a module (dataclasses look their module up in sys.modules)
    module = types.ModuleType(namespace["__name__"])
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)
    except Exception:
        pytest.fail(f"{block.name}: the block raised:\n{block.text}\n{traceback.format_exc(limit=-8)}")
    finally:
        namespace.update(module.__dict__)
        sys.modules.pop(module.__name__, None)


def pages_to_run() -> list[Path]:
    return [page for page in PAGES if any(runnable(b) for b in blocks_of(page))]


@pytest.mark.parametrize("page", pages_to_run(), ids=lambda p: p.name)
def test_page_runs(page, tmp_path, monkeypatch, tiny_models, request):
    """Every block of the page but those marked accelerator (``test_accelerator_blocks_run`` runs the page with
    them)."""
    _run_page(page, tmp_path, monkeypatch, tiny_models, request, accelerator_blocks=False)


@on_accelerator
@pytest.mark.parametrize(
    "page", [p for p in pages_to_run() if any(b.mark == "accelerator" for b in blocks_of(p))], ids=lambda p: p.name
)
def test_accelerator_blocks_run(page, tmp_path, monkeypatch, tiny_models, request):
    """The whole page, its accelerator blocks included, on the accelerator: without CUDA the CPU is one, under
    the strict model, and a block's default device (``cpu``) computes through the accelerator path."""
    _run_page(page, tmp_path, monkeypatch, tiny_models, request, accelerator_blocks=True)


def _run_page(page, tmp_path, monkeypatch, tiny_models, request, *, accelerator_blocks: bool) -> None:
    torch.manual_seed(0)
    blocks = blocks_of(page)
    substitution = Substitution(monkeypatch, tmp_path, tiny_models)
    code = "".join(b.text for b in blocks if runnable(b) and b.language == "python")
    namespace = substitution.namespace(code)
    with contextlib.ExitStack() as stack:
        if page.name == "writing-a-plugin.md":  # the page's own packages, installed as its bash block says
            monkeypatch.syspath_prepend(str(request.getfixturevalue("guide_site")))
            memmode_core.discovery.plugins.reset()
            stack.callback(_forget_modules, *GUIDE_PACKAGES)
        if "fully_shard" in code:  # what torchrun gives each rank; here one rank
            stack.enter_context(_one_rank_process_group(tmp_path))
        for block in blocks:
            if block.mark == "accelerator":
                if not accelerator_blocks:
                    continue
                block.mark = None
            if not runnable(block):
                continue
            if block.language == "python":
                run_python(block, substitution, namespace)
                continue
            for command in commands_of(block, substitution.source):
                kind = kind_of(command)
                assert kind != "unknown", f"{block.name}: no way to run {shlex.join(command)}"
                if kind == "cli":
                    run_cli(substitution, command[1:], block.name)
                elif kind == "benchmark":
                    check_benchmark(command, block.name)


GUIDE_PACKAGES = tuple(GUIDE_DISTRIBUTIONS.values())


def _forget_modules(*names: str) -> None:
    """The guide's packages were imported from a folder that is gone after the test."""
    for name in names:
        sys.modules.pop(name, None)


@contextlib.contextmanager
def _one_rank_process_group(tmp: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- what the install commands install --------------------------------------------------------------------

#: packages the pages install that are not memmode's: the benchmarks' competitors (docs/benchmarks.md)
THIRD_PARTY = {"optimum-quanto", "torchao"}


def _requirement_name(line: str) -> str:
    return re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower()


def distributions() -> dict[str, Path]:
    """memmode's own distributions in this repository: name -> folder."""
    found = {}
    for pyproject in [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]:
        found[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent
    return found


def installed_by(argument: str, folder: Path = ROOT) -> set[str]:
    """What ``pip install ARGUMENT`` installs, by name: a requirements file's lines (recursively), a
    folder's distribution and its dependencies, or a name."""
    dists = distributions()
    path = (folder / argument).resolve()
    if path.is_dir():
        project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
        return {project["name"]} | {_requirement_name(d) for d in project.get("dependencies", [])}
    name = _requirement_name(argument)
    return {name} | (installed_by(str(dists[name]), ROOT) if name in dists else set())


def requirements(file: Path) -> set[str]:
    names = set()
    for line in file.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            names |= requirements(file.parent / line[3:].strip())
        elif line.startswith("-e "):
            names |= installed_by(line[3:].strip(), file.parent)
        elif line:
            names |= installed_by(line, file.parent)
    return names


def pinned(file: Path) -> dict[str, str]:
    pins = {}
    for line in file.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line and not line.startswith("-"):
            pins[_requirement_name(line)] = line.split("==", 1)[1].strip()
    return pins


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_install_commands_install_what_exists(page):
    """``pip install`` lines are not run (CI installed requirements-test.txt), but what they name must exist,
    and what a page's commands need must be installed by the installs above them on the page (on a page
    without one, by the README's: requirements.txt)."""
    guide_packages = {relative.split("/")[0] for relative in files_from_the_guide()}
    dists, pins = distributions(), pinned(ROOT / "requirements.txt")
    installed: set[str] = set()
    for block in blocks_of(page):
        if not runnable(block) or block.language == "python":
            continue
        for command in commands_of(block):
            where = f"{block.name}: {shlex.join(command)}"
            if kind_of(command) == "install":
                words = iter(command[command.index("install") + 1 :])
                for word in words:
                    if word == "-r":
                        file = next(words)
                        assert (ROOT / file).is_file(), f"{where}: there is no {file}"
                        installed |= requirements(ROOT / file)
                    elif word.startswith("./"):
                        assert word[2:] in guide_packages, f"{where}: {word} is not a package of the plugin guide"
                        installed.add(word[2:])
                    elif not word.startswith("-"):
                        name = _requirement_name(word)
                        assert name in dists or name in pins or name in THIRD_PARTY, f"{where}: no package {name}"
                        if "==" in word and name in pins:
                            assert word.split("==", 1)[1] == pins[name], f"{where}: requirements.txt pins {pins[name]}"
                        installed |= installed_by(word)
            elif kind_of(command) == "cli":
                have = installed or requirements(ROOT / "requirements.txt")
                for flag, needed in FLAG_NEEDS.items():
                    if flag in command:
                        assert needed in have, f"{where}: {flag} needs {needed}, which the install above lacks"


# -- figures the pages state -----------------------------------------------------------------------------------

#: the files that state the demo pipeline's size and the quantizers' bytes
STATING = [*PAGES, ROOT / "memmode_core" / "demo.py", *sorted((ROOT / "memmode_core" / "cli").glob("*.py"))]
PER_TRANSFORMER = re.compile(r"(\d+(?:\.\d+)?)\s+([kMB])\s+parameters\s+per\s+transformer")


def test_the_stated_demo_sizes_are_measured():
    from memmode_core.demo import SIZES, make_demo_pipeline

    with torch.device("meta"):  # the parameters' number, without their memory
        measured = {size: sum(p.numel() for p in make_demo_pipeline(size).transformer.parameters()) for size in SIZES}
    scale = {"k": 1e3, "M": 1e6, "B": 1e9}
    stated = set()
    for file in STATING:
        for match in PER_TRANSFORMER.finditer(file.read_text()):
            value, unit = float(match[1]) * scale[match[2]], scale[match[2]]
            half_a_digit = 0.5 * 10 ** -len(match[1].partition(".")[2]) * unit
            assert any(abs(value - n) <= half_a_digit for n in measured.values()), (
                f"{file.relative_to(ROOT)}: {match[0]!r}, but the demo's transformers have {measured} parameters"
            )
            stated.add(file.name)
    assert {"README.md", "getting-started.md", "demo_pipeline.py", "parser.py"} <= stated


def _quantize(quantizer: str, module, **options) -> dict:
    handle = memmode_core.apply(module, f"model_full_load_and_{quantizer}", device="cpu", **options)
    return next(iter(handle.report().quantization.values()))


def _figure(summary: dict) -> str:
    return f"{summary['bytes_after'] / summary['bytes_before']:.2f}×"


def test_the_stated_quantized_bytes_are_measured():
    """Each packed layer's bytes over its bf16 bytes, and a whole transformer's: the small demo's, measured
    here, and the benchmark's (docs/benchmarks.md's table); docs/quantizers.md and docs/modes.md say them."""
    from memmode_core.demo import make_demo_pipeline

    rows, columns = 256, 512
    layer_bytes = {"qfloat8": rows * columns + 4 * rows, "qfloat4": rows * columns * 9 // 16 + 4}
    per_layer, demo, benchmark = {}, {}, {}
    transformers = make_demo_pipeline("small", dtype=torch.bfloat16)
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    for quantizer, transformer in zip(layer_bytes, (transformers.transformer, transformers.transformer_2)):
        layer = torch.nn.Sequential(torch.nn.Linear(columns, rows, bias=False, dtype=torch.bfloat16))
        summary = _quantize(quantizer, layer, default_exclude=())  # a lone layer is outside any block
        assert summary["bytes_after"] == layer_bytes[quantizer], quantizer  # what quantizers.md says a layer holds
        per_layer[quantizer] = _figure(summary)
        demo[quantizer] = _figure(_quantize(quantizer, transformer))
        measured = re.search(rf"\| \*\*memmode {quantizer}\*\* \| [^|]+ \| \*\*([\d.]+)\*\* \|", benchmarks)
        benchmark[quantizer] = f"{float(measured[1]):.2f}×"
    quantizers, modes = ((ROOT / "docs" / name).read_text() for name in ("quantizers.md", "modes.md"))
    q8, q4 = "qfloat8", "qfloat4"
    for quantizer in layer_bytes:
        row = next(line for line in quantizers.splitlines() if line.startswith(f"| `{quantizer}` |"))
        assert f"| {per_layer[quantizer]} per layer |" in row, row
    assert (
        f"{benchmark[q8]} (qfloat8) and {benchmark[q4]} (qfloat4) for the Wan-shaped transformer above, "
        f"{demo[q8]} and\n{demo[q4]} for the small demo pipeline's"
    ) in quantizers
    assert f"{per_layer[q8]} (qfloat8) or {per_layer[q4]} (qfloat4) of its bf16 bytes" in modes
    assert f"{benchmark[q8]} or {benchmark[q4]} for a Wan transformer\n({demo[q8]} / {demo[q4]}" in modes


#: words every page may use that the glossary must explain
GLOSSARY_TERMS = [
    *("stand-in", "placeholder", "slot", "ledger", "residency", "workspace", "lent", "borrowed", "made once"),
    *("group", "placement", "quantizer", "storage", "mode", "packed", "at rest", "resting", "onload", "offload"),
    *("prefetch", "plan", "prepared plan", "kit", "streamed"),
]


def test_the_glossary_explains_each_word_and_names_modules_that_exist():
    """docs/glossary.md gives each word the module that owns it: a module moved or renamed must be moved there
    too, and the README's layout links the page."""
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in (ROOT / "docs" / "glossary.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| term |")
    ]
    terms = {term for row in rows for term in re.split(r",\s*", re.sub(r"\s*\(.*?\)", "", row[0]))}
    assert set(GLOSSARY_TERMS) <= terms, f"not in the glossary: {sorted(set(GLOSSARY_TERMS) - terms)}"
    for term, _, where in rows:
        owners = re.findall(r"`([^`]+)`", where)
        assert owners, f"the glossary gives {term!r} no module"
        for owner in owners:
            assert (ROOT / owner).exists(), f"docs/glossary.md: {term!r} lives in {owner}, which is not there"
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    assert "docs/glossary.md" in layout
