"""What every tiny pipeline of the suite is built from: tokenizers, seeded components, shared model configurations,
schedulers and call inputs, and the table a family is (``Family``) with the one function that builds it.

Nothing may be downloaded, so every component -- the tokenizers included -- is built in code from a config with
random weights:

* each ``torch.nn.Module`` is created right after ``torch.manual_seed`` with a seed derived from ``(seed, component
  name)`` (``component``), so two builds with the same seed hold bit-identical weights whatever the construction
  order, two components of the same architecture (``transformer`` / ``transformer_2``, the two CLIP encoders of
  SD3) still get different weights, and the caller's global RNG is left alone;
* tokenizers are the classes the pipelines expect (``CLIPTokenizer``, ``T5Tokenizer``, ``Qwen2Tokenizer``, Gemma's,
  BERT's, GLM's, RoBERTa's) built from a small in-code vocabulary (a few hundred tokens); the text encoders'
  ``vocab_size`` matches it;
* dimensions are tiny (hidden sizes 16-64, two blocks in every block list, 16x16 or 32x32 images, a handful of
  frames) and follow the ``get_dummy_components()`` of diffusers' own tests, so that building and calling a
  pipeline takes a few tens of milliseconds on CPU;
* with a low-precision ``dtype`` the modules that ``from_pretrained(torch_dtype=...)`` keeps in float32 (e.g.
  Wan's norms and time embedder) stay in float32 here too;
* parameters a fresh model initialises to zero and a checkpoint fills get small random values
  (``with_trained_zero_convs``), or the component or input that goes through them would have no influence.

A family (``Family``) is a table: the pipeline class, its parts by component name (``Model``: a module built under
its seed; ``Text``: a tokenizer and the encoder built for its vocabulary; any other callable is called, anything
else passed as it is), the call's keyword arguments, and what is particular to it. The families are in
``tiny_dit_pipelines``, ``tiny_unet_pipelines``, ``tiny_video_pipelines``, ``tiny_audio_pipelines`` and
``tiny_prior_pipelines``; ``tiny_pipelines`` is the API over all of them.

The suite also runs on the oldest diffusers and transformers memmode supports (pyproject's lower bounds: CI's
lowest-versions lane). A family built from a class that came after those releases takes it through :func:`lookup`,
written once here, instead of importing it: on an older release that family's tests are skipped, saying which name is
missing, and every other family runs (an import of a missing name would break the whole suite's collection).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.metadata
import json
import re
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLWan, AutoencoderOobleck, CogVideoXDDIMScheduler, DiffusionPipeline
from diffusers.models.modeling_utils import ModelMixin
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizer,
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTokenizer,
    CLIPVisionConfig,
    Gemma2Config,
    Gemma2Model,
    GemmaTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    RobertaTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

PROMPT = "a tiny red fox jumps over the lazy dog"
NEGATIVE_PROMPT = "blurry, low quality"

# Text the tokenizers have whole-word tokens for; anything else falls back to characters (or to the unknown
# token).  Besides the prompts it holds QwenImage's prompt template, whose system part then is 34 tokens long as
# with the real Qwen tokenizer (the pipeline drops exactly that many tokens from the encoder output).
CORPUS = "\n".join(
    [
        PROMPT,
        NEGATIVE_PROMPT,
        "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
        "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
        "<|im_end|>\n<|im_start|>assistant\n",
    ]
)
CHARS = string.ascii_letters + string.digits + string.punctuation

CLIP_MAX_LENGTH = 16  # tokenizer.model_max_length = CLIP max_position_embeddings
MAX_SEQUENCE_LENGTH = 16  # T5 / Qwen text length: the pipelines' max_sequence_length in the calls
#: BERT's and LDM-BERT's padded prompt length (HunyuanDiT and LDM hard-code 77).
BERT_MAX_LENGTH = 77
#: Text length of the RoBERTa tokenizers (CLAP); the CLAP position table holds it plus RoBERTa's offset.
ROBERTA_MAX_LENGTH = 16

# Lumina 2 prepends this system prompt (the pipeline's default) to every prompt: the Gemma tokenizer has whole-word
# tokens for it, so the encoder sees prompts of about the real token count.
LUMINA2_SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text "
    "alignment based on textual prompts or user prompts. <Prompt Start> "
)
_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
_ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # bos=0, pad=1, eos=2, unk=3 as RoBERTa's


# --------------------------------------------------------------------------- what an older release lacks


class Unavailable:
    """What :func:`lookup` gives for a name the installed library lacks: building what needs it (calling it, or
    reading any of its attributes) skips the test, with the reason, instead of breaking the suite's collection."""

    def __init__(self, reason: str):
        self._reason = reason

    def __call__(self, *args, **kwargs):
        pytest.skip(self._reason)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and introspection probe these: no build asks for them
            raise AttributeError(name)
        pytest.skip(self._reason)

    def __repr__(self) -> str:
        return f"<unavailable: {self._reason}>"


def lookup(module: str, name: str) -> Any:
    """``module``'s ``name`` (``from module import name``), or, where the installed library lacks it, an
    :class:`Unavailable` whose use skips the test: ``"needs diffusers.AceStepPipeline, which diffusers 0.37.0 lacks
    (...)"``. Only for a name newer than pyproject's lower bound (``AceStepPipeline = lookup("diffusers",
    "AceStepPipeline")``, with a comment saying which release brought it): every other name is imported as usual,
    and breaks collection if it goes missing."""
    library = module.partition(".")[0]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, RuntimeError) as error:  # diffusers' lazy import raises RuntimeError
        why = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        version = importlib.metadata.version(library)
        return Unavailable(f"needs {module}.{name}, which {library} {version} lacks ({why})")


# --------------------------------------------------------------------------- tokenizers


def _prefix_merges(words: list[list[str]]) -> list[tuple[str, str]]:
    """BPE merges that build each word (a list of initial symbols) left to right.

    Shorter merges rank first; a word whose merges conflict with another word's simply ends up as a few sub-word
    tokens, which is still a valid encoding.
    """
    merges: dict[tuple[str, str], None] = {}
    for symbols in words:
        head = symbols[0]
        for symbol in symbols[1:]:
            merges.setdefault((head, symbol), None)
            head += symbol
    return sorted(merges, key=lambda merge: len(merge[0]) + len(merge[1]))


def _bpe_vocab(specials: list[str], alphabet: list[str], merges: list[tuple[str, str]]) -> dict[str, int]:
    tokens = dict.fromkeys([*specials, *alphabet, *("".join(merge) for merge in merges)])
    return {token: index for index, token in enumerate(tokens)}


def _pre_tokenized(tokenizer, text: str) -> list[str]:
    """The pieces ``tokenizer``'s normalizer + pre-tokenizer cut ``text`` into (special tokens excluded)."""
    backend = tokenizer.backend_tokenizer
    pieces = []
    for line in text.replace("<|im_start|>", "\n").replace("<|im_end|>", "\n").split("\n"):
        normalized = backend.normalizer.normalize_str(line) if backend.normalizer else line
        pieces += [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]
    return pieces


def clip_tokenizer() -> CLIPTokenizer:
    """Byte-level BPE (lower-cased ASCII, ``</w>`` word suffix); ``<|endoftext|>`` is eos, pad and unk."""
    specials = ["<|startoftext|>", "<|endoftext|>"]
    alphabet = sorted(set(CHARS.lower()))
    alphabet += [char + "</w>" for char in alphabet]
    words = [piece for piece in _pre_tokenized(CLIPTokenizer(), CORPUS) if len(piece) > 1]
    merges = _prefix_merges([[*piece[:-1], piece[-1] + "</w>"] for piece in words])
    return CLIPTokenizer(vocab=_bpe_vocab(specials, alphabet, merges), merges=merges, model_max_length=CLIP_MAX_LENGTH)


def t5_tokenizer() -> T5Tokenizer:
    """Unigram model: whole words of the corpus, single characters as fallback; pad=0, eos=1, unk=2."""
    words = sorted({word.strip(string.punctuation) for word in CORPUS.split()} - {""})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -1.0) for word in words] + [(char, -5.0) for char in CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH)


def byte_level_bpe(tokenizer_cls, specials: list[str], text: str, **kwargs):
    """A byte-level BPE tokenizer of ``tokenizer_cls`` (GPT-2 / RoBERTa / Qwen layout): the ``specials``,
    all 256 byte symbols, then merges that make each pre-tokenized word of ``text`` a single token."""
    for special in specials:
        text = text.replace(special, "\n")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = [piece for piece in _pre_tokenized(tokenizer_cls(), text) if len(piece) > 1]
    merges = _prefix_merges([list(piece) for piece in words])
    return tokenizer_cls(vocab=_bpe_vocab(specials, alphabet, merges), merges=merges, **kwargs)


def qwen_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE over all 256 bytes plus the corpus' words, with Qwen's chat special tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return byte_level_bpe(Qwen2Tokenizer, specials, CORPUS, extra_special_tokens=specials[1:])


def roberta_tokenizer() -> RobertaTokenizer:
    """CLAP's tokenizer class; AudioLDM pads every prompt to ``model_max_length``."""
    return byte_level_bpe(RobertaTokenizer, _ROBERTA_SPECIALS, CORPUS, model_max_length=ROBERTA_MAX_LENGTH)


def sentencepiece_bpe(tokenizer_cls, specials: list[str], text: str, **kwargs):
    """A byte-fallback BPE tokenizer of ``tokenizer_cls`` (the Gemma / Llama layout), trained on ``text``.

    The vocabulary is ``specials``, the 256 ``<0xNN>`` byte tokens, then what ``tokenizers``' BPE trainer learns
    from the words of ``text``, with and without the ``▁`` word-start marker (a word right after a special token or
    a newline carries none).  Encoding a trained word replays its training merges, so every word of ``text`` is one
    token, as with a real vocabulary; anything else falls back to characters or bytes.
    """
    for special in specials:
        text = text.replace(special, " ")
    words = sorted(set(text.split()))
    trainer = trainers.BpeTrainer(vocab_size=1 << 16, initial_alphabet=[*CHARS, "\u2581"], show_progress=False)
    bpe = Tokenizer(models.BPE())
    bpe.train_from_iterator(["\u2581" + word for word in words] + words, trainer)
    model = json.loads(bpe.to_str())["model"]
    learned = sorted(model["vocab"], key=model["vocab"].get)
    tokens = dict.fromkeys([*specials, *(f"<0x{byte:02X}>" for byte in range(256)), *learned])
    vocab = {token: index for index, token in enumerate(tokens)}
    return tokenizer_cls(vocab=vocab, merges=[tuple(merge) for merge in model["merges"]], **kwargs)


def gemma_tokenizer() -> GemmaTokenizer:
    """Gemma's layout (pad=0, eos=1, bos=2, unk=3), padding on the right as SANA and Lumina 2 set it."""
    text = "\n".join([PROMPT, NEGATIVE_PROMPT, LUMINA2_SYSTEM_PROMPT])
    return sentencepiece_bpe(GemmaTokenizer, _GEMMA_SPECIALS, text, padding_side="right")


def bert_tokenizer() -> BertTokenizer:
    """Lower-cased WordPiece: the prompts' whole words, single characters and ``##`` continuations as fallback;
    ``[PAD]`` = 0 as in BERT's vocabularies."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(set(re.findall(r"\w+|[^\w\s]", f"{PROMPT} {NEGATIVE_PROMPT}".lower())))
    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation))
    pieces = [*specials, *words, *chars, *("##" + char for char in string.ascii_lowercase + string.digits)]
    vocab = {piece: index for index, piece in enumerate(dict.fromkeys(pieces))}
    return BertTokenizer(vocab=vocab, model_max_length=BERT_MAX_LENGTH)


def glm_tokenizer() -> PreTrainedTokenizerFast:
    """GLM-4's layout: byte-level BPE (trained here on the prompts, so each of their words is one token), the
    ``[gMASK]<sop>`` prefix on every encoding, ``<|endoftext|>`` as pad, padding on the left."""
    specials = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1 << 16,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([PROMPT, NEGATIVE_PROMPT], trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A",
        pair="[gMASK] <sop> $A $B",
        special_tokens=[(token, bpe.token_to_id(token)) for token in ("[gMASK]", "<sop>")],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        padding_side="left",
        additional_special_tokens=specials[1:],
    )


# --------------------------------------------------------------------------- seeded components


def component_seed(seed: int, name: str) -> int:
    """A seed for one component (or call input): stable across processes, different for each (seed, name)."""
    return zlib.crc32(f"{seed}/{name}".encode())


def _fp32_names(module: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Submodule names that ``from_pretrained(torch_dtype=dtype)`` would keep in float32."""
    if isinstance(module, ModelMixin):  # diffusers: for any low-precision dtype
        return set(module._keep_in_fp32_modules or [])
    names = set(getattr(module, "_keep_in_fp32_modules_strict", None) or [])  # transformers
    if dtype == torch.float16:
        names |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    return names


def cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point weights to ``dtype`` in place, sparing the modules real checkpoints keep in float32.

    (``module.to(dtype)`` would cast everything, and diffusers warns about it.)
    """
    keep = _fp32_names(module, dtype)
    for name, tensor in chain(module.named_parameters(), module.named_buffers()):
        if tensor.is_floating_point() and keep.isdisjoint(name.split(".")):
            tensor.data = tensor.data.to(dtype)


@contextlib.contextmanager
def _uninitialized_memory_is_nan():
    """``torch.empty`` fills floating-point memory with NaN while this is active.

    Some models leave a parameter uninitialized and count on the checkpoint to fill it (Lumina-Next's
    ``pad_token = nn.Parameter(torch.empty(...))``): built from config, it would hold whatever the allocator
    returned, which differs from one build to the next (a NaN in one, plausible numbers in the other) and makes
    two builds of one seed disagree.  PyTorch's deterministic mode fills such memory with NaN, which
    :func:`component` then replaces with seeded values.
    """
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def component(name: str, factory: Callable[[], torch.nn.Module], *, seed: int, dtype: torch.dtype):
    """``factory()`` run under its own seed (without disturbing the caller's global RNG), cast, in eval mode.

    Tensors the model leaves uninitialized (``torch.empty``: NaN here, see :func:`_uninitialized_memory_is_nan`)
    get seeded normal values, as a checkpoint would give them.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(component_seed(seed, name))
        with _uninitialized_memory_is_nan():
            module = factory()
        with torch.no_grad():
            for tensor in chain(module.parameters(), module.buffers()):
                if tensor.is_floating_point() and tensor.isnan().any():
                    tensor.copy_(torch.where(tensor.isnan(), torch.randn_like(tensor) * 0.02, tensor))
    cast(module, dtype)
    return module.eval()


def seeded(factory: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    """``factory()`` built right after seeding the global RNG with ``seed``, in eval mode: two builds hold identical
    weights (the bare models of some tests, built as diffusers' tests build theirs)."""
    torch.manual_seed(seed)
    return factory().eval()


def with_trained_zero_convs(
    factory: Callable[[], torch.nn.Module], *, below: float | None = None
) -> Callable[[], torch.nn.Module]:
    """``factory``, with the parameters it initialises to zero (with ``below``: to values all smaller than it in
    magnitude) filled with small random values.

    A fresh ControlNet's "zero convolutions" make its residuals exactly zero, so the control image and most of its
    weights would have no influence on the output; a trained ControlNet's do.
    """

    def untrained(parameter: torch.Tensor) -> bool:
        return not parameter.any() if below is None else bool(parameter.abs().max() < below)

    def build():
        module = factory()
        with torch.no_grad():
            for parameter in module.parameters():
                if untrained(parameter):
                    parameter.normal_(std=0.05)
        return module

    return build


# --------------------------------------------------------------------------- families: the table and its build


def configured(cls, *configs: dict) -> Callable[[], Any]:
    """``cls`` called with the configs merged left to right (each call gets its own copy of their values)."""
    merged = {key: value for config in configs for key, value in config.items()}
    return lambda: cls(**copy.deepcopy(merged))


@dataclass(frozen=True)
class Model:
    """A part that is a module: ``factory()`` built under its component's seed, cast and in eval mode."""

    factory: Callable[[], torch.nn.Module]


def model(cls, *configs: dict, zeros_filled: bool = False) -> Model:
    """A ``cls`` module of the merged ``configs``; with ``zeros_filled``, its zero-initialised parameters filled."""
    factory = configured(cls, *configs)
    return Model(with_trained_zero_convs(factory) if zeros_filled else factory)


@dataclass(frozen=True)
class Text:
    """A tokenizer (``tokenizer()``) and the text encoder built for its vocabulary (``encoder(tokenizer)``: a module
    factory). The tokenizer takes the encoder's name with ``text_encoder`` made ``tokenizer`` (else ``tokenizer``)."""

    tokenizer: Callable[[], Any]
    encoder: Callable[[Any], Callable[[], torch.nn.Module]]


def tokenizer_name(encoder: str) -> str:
    return encoder.replace("text_encoder", "tokenizer") if "text_encoder" in encoder else "tokenizer"


@dataclass(frozen=True)
class Family:
    """One tiny pipeline: what it is made of and how it is called.

    ``parts``: component name -> ``Model``, ``Text``, another callable (called at each build: schedulers,
    processors) or a value (passed as it is). ``call``: the call's keyword arguments. ``outputs``: the fields of
    the output object that ``run`` concatenates; ``None``: the first item of ``return_dict=False``'s tuple.
    ``inputs(seed, call)``: the call's keyword arguments derived from the call seed (images, embeddings).
    ``rewritten``: tensors the pipeline itself rewrites at every call, which ``remove()`` is not expected to give
    back as a fresh build holds them; ``chaotic``: why a quantized output is only checked for finiteness.
    """

    kind: str
    pipeline: Callable[..., DiffusionPipeline]
    parts: dict[str, Any]
    call: dict
    outputs: tuple[str, ...] | None = None
    inputs: Callable[[int, dict], dict] | None = None
    rewritten: tuple[str, ...] = field(default_factory=tuple)
    chaotic: str | None = None

    def make(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
        """A fresh pipeline; all components in eval mode, on CPU, in ``dtype``."""
        build = partial(component, seed=seed, dtype=dtype)
        kwargs = {}
        for name, part in self.parts.items():
            if isinstance(part, Model):
                kwargs[name] = build(name, part.factory)
            elif isinstance(part, Text):
                tokenizer = part.tokenizer()
                kwargs[tokenizer_name(name)] = tokenizer
                kwargs[name] = build(name, part.encoder(tokenizer))
            else:
                kwargs[name] = part() if callable(part) else part
        pipe = self.pipeline(**kwargs)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call_kwargs(self, seed: int = 0) -> dict:
        """Keyword arguments (a fresh dict, without ``generator``) for one small, fast call."""
        kwargs = dict(self.call)
        if self.inputs is not None:
            kwargs.update(self.inputs(seed, kwargs))
        return kwargs

    def run(self, pipe: DiffusionPipeline, seed: int = 0) -> torch.Tensor:
        """Call ``pipe`` once with a CPU generator seeded with ``seed``: the images, frames, waveforms or embeddings
        as a float32 tensor on CPU."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        if self.outputs is None:
            output = torch.as_tensor(pipe(**self.call_kwargs(seed), generator=generator, return_dict=False)[0])
        else:
            # The output object's fields by name: with return_dict=False some pipelines (SVD, the cascade decoders)
            # return the frames or images themselves rather than a tuple.
            result = pipe(**self.call_kwargs(seed), generator=generator)
            output = torch.cat([torch.as_tensor(getattr(result, name)) for name in self.outputs])
        return output.detach().to(device="cpu", dtype=torch.float32)


# --------------------------------------------------------------------------- text encoders


def vocabulary(tokenizer, *special: str) -> dict:
    """What an encoder's config takes from its tokenizer: ``vocab_size``, and the ``<name>_token_id`` of each of
    ``special`` (``"pad"``, ``"bos"``, ``"eos"``)."""
    return {
        "vocab_size": len(tokenizer),
        **{f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in special},
    }


#: The T5-family encoders' depth and attention, whatever their width.
_T5_LAYERS = {
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "dropout_rate": 0.0,
}


def t5_encoder(model_cls, config_cls, tokenizer, d_model: int = 32):
    """A two-layer T5-family encoder of width ``d_model`` for ``tokenizer``'s vocabulary."""
    config = config_cls(
        **vocabulary(tokenizer, "pad", "eos"),
        **_T5_LAYERS,
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return lambda: model_cls(config)


def clip_encoder(model_cls, tokenizer, hidden_size: int = 32):
    """A two-layer CLIP text encoder of ``model_cls`` for ``tokenizer``."""
    config = CLIPTextConfig(
        **vocabulary(tokenizer, "bos", "eos", "pad"),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act="gelu",
    )
    return lambda: model_cls(config)


def lm_encoder(
    model_cls, config_cls, tokenizer, *, hidden_size=16, heads=2, kv_heads=1, layers=2, max_positions=512, **config
):
    """A decoder-only language model of ``model_cls`` as a text encoder (Gemma, Llama, GLM, Qwen3): ``layers``
    layers, grouped-query attention (``heads`` query and ``kv_heads`` key/value heads, 8 wide), the tokenizer's
    vocabulary and special tokens; ``config``, what else ``config_cls`` is given."""
    config = config_cls(
        **vocabulary(tokenizer, "pad", "bos", "eos"),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=max_positions,
        **config,
    )
    return lambda: model_cls(config)


def bert_encoder(tokenizer, hidden_size: int = 32):
    """A two-layer ``BertModel`` for ``tokenizer``, its positions as long as the padded prompt."""
    config = BertConfig(
        **vocabulary(tokenizer, "pad"),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=BERT_MAX_LENGTH,
    )
    return lambda: BertModel(config)


def clip_vision_encoder(model_cls, hidden_size: int, *, image_size: int, patch_size: int, heads: int = 2) -> Model:
    """A two-layer CLIP vision encoder of ``model_cls`` (with projection: as wide as the hidden states)."""
    config = {
        "hidden_size": hidden_size,
        "projection_dim": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    return Model(lambda: model_cls(CLIPVisionConfig(**config)))


def clip_image_processor(size: int) -> CLIPImageProcessor:
    """A CLIP image processor that resizes and crops to ``size`` pixels (the vision encoder's input)."""
    return CLIPImageProcessor(crop_size=size, size=size)


#: The text encoders most families use, with their tokenizers.
T5 = Text(t5_tokenizer, partial(t5_encoder, T5EncoderModel, T5Config))
UMT5 = Text(t5_tokenizer, partial(t5_encoder, UMT5EncoderModel, UMT5Config))
#: SANA's and Lumina 2's text encoder: a ``Gemma2Model`` (GQA, soft-capping, sliding window: the real encoder's
#: architecture).
GEMMA2 = Text(gemma_tokenizer, partial(lm_encoder, Gemma2Model, Gemma2Config, sliding_window=8))


def clip(model_cls, hidden_size: int = 32) -> Text:
    """A CLIP text encoder of ``model_cls`` (``CLIPTextModel``, or ``...WithProjection``) and its tokenizer."""
    return Text(clip_tokenizer, partial(clip_encoder, model_cls, hidden_size=hidden_size))


# --------------------------------------------------------------------------- autoencoders


def mirrored(down: tuple[str, ...]) -> tuple[str, ...]:
    """The up blocks that mirror the down blocks ``down``: in reverse order, ``Down`` made ``Up`` and ``Encoder``
    ``Decoder`` (``CrossAttnDownBlock2D`` -> ``CrossAttnUpBlock2D``, ``DownEncoderBlock2D`` -> ``UpDecoderBlock2D``)."""
    return tuple(block.replace("Down", "Up").replace("Encoder", "Decoder") for block in reversed(down))


def blocks(*down: str) -> dict:
    """``down_block_types`` and the ``up_block_types`` that mirror them."""
    return {"down_block_types": down, "up_block_types": mirrored(down)}


def unet_levels(size: int, channels: int, widths: tuple[int, ...], *down: str) -> dict:
    """A UNet's sample size, its channels in and out, and its levels: ``widths`` wide, one layer each, the ``down``
    blocks and the up blocks that mirror them."""
    levels = {"block_out_channels": widths, "layers_per_block": 1}
    return {"sample_size": size, "in_channels": channels, "out_channels": channels, **blocks(*down), **levels}


def kl_vae(
    latent_channels: int,
    *,
    scaling_factor: float,
    shift_factor: float | None = None,
    quant_conv: bool = True,
    levels: int = 2,
    channels: int = 3,
    sample_size: int = 32,
) -> Model:
    """An ``AutoencoderKL`` with ``levels`` resolution levels (spatial scale factor ``2 ** (levels - 1)``) for images
    of ``channels`` channels (1: a mel spectrogram).

    ``quant_conv=False`` is the Flux-family VAE (Flux, Chroma, Lumina 2): no ``quant_conv`` / ``post_quant_conv``
    modules at all, as in those checkpoints.
    """
    return model(
        AutoencoderKL,
        {
            "in_channels": channels,
            "out_channels": channels,
            **blocks(*["DownEncoderBlock2D"] * levels),
            "block_out_channels": (8, 16, 16, 16)[:levels],
            "layers_per_block": 1,
            "latent_channels": latent_channels,
            "norm_num_groups": 4,
            "sample_size": sample_size,
            "scaling_factor": scaling_factor,
            "shift_factor": shift_factor,
            "use_quant_conv": quant_conv,
            "use_post_quant_conv": quant_conv,
        },
    )


#: The Flux / SD3 VAE here: two levels (spatial scale factor 2), four latent channels, shift and scale.
IMAGE_VAE = kl_vae(4, scaling_factor=1.5035, shift_factor=0.0609, sample_size=16)
#: The Stable Diffusion 1.x / SDXL VAE layout: four latent channels, ``quant_conv`` kept.
SD_VAE = kl_vae(4, scaling_factor=0.18215)
#: The Flux-family VAE: 16 latent channels, shift and scale, no ``quant_conv`` / ``post_quant_conv``, spatial scale
#: factor 8 (Lumina 2 assumes it rather than reading the config).
FLUX_VAE = kl_vae(16, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False, levels=4)


def factor8_vae(latent_channels: int = 4, scaling_factor: float = 0.13025) -> Model:
    """A four-level ``AutoencoderKL`` (spatial factor 8), for the pipelines that assume one."""
    return kl_vae(latent_channels, scaling_factor=scaling_factor, levels=4)


#: The Wan 2.1 / 2.2 causal 3D VAE (16 latent channels, spatial x8, temporal x4).
WAN_VAE = model(
    AutoencoderKLWan,
    {
        "base_dim": 4,
        "z_dim": 16,
        "dim_mult": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True, True],
    },
)


def oobleck_vae(latent_channels: int) -> Model:
    """The Stable Audio Open VAE layout (``AutoencoderOobleck``: stereo waveform, hop length 2)."""
    return model(
        AutoencoderOobleck,
        {
            "encoder_hidden_size": 6,
            "downsampling_ratios": [1, 2],
            "decoder_channels": 3,
            "decoder_input_channels": latent_channels,
            "audio_channels": 2,
            "channel_multiples": [2, 4],
            "sampling_rate": 4,
        },
    )


# --------------------------------------------------------------------------- denoiser configurations

#: ``WanTransformer3DModel``: two blocks, the text-to-video layout (image conditioning and other sizes by merging
#: another config over it).
WAN_TRANSFORMER = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,  # UMT5 d_model
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}

#: The dual- and single-stream blocks of Flux-shaped transformers (Flux, Chroma).
FLUX_BLOCKS = {
    "patch_size": 1,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # T5 d_model
    "axes_dims_rope": (4, 4, 8),
}

#: The down path shared by the UNets and the ControlNet: one plain level and one cross-attention level (as
#: diffusers' dummy UNets); 4 latent channels, CLIP-width (32) cross-attention unless said otherwise.
UNET_DOWN = {
    "in_channels": 4,
    "block_out_channels": (8, 16),
    "layers_per_block": 1,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "norm_num_groups": 4,
    "attention_head_dim": 2,
    "cross_attention_dim": 32,
}
#: A two-level ``UNet2DConditionModel`` (the SD 1.5 layout; merged with another config, SDXL's and others').
SD_UNET = {
    **UNET_DOWN,
    "sample_size": 8,
    "out_channels": 4,
    "up_block_types": mirrored(UNET_DOWN["down_block_types"]),
}

#: The PixArt DiT (adaLN-single, cross-attention to T5, learned sigma) of PixArt-Alpha / Sigma, on which Latte's
#: spatial/temporal blocks are built.
PIXART_DIT = {
    "sample_size": 8,
    "num_layers": 2,
    "patch_size": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 3,
    "caption_channels": 32,  # T5 d_model
    "in_channels": 4,
    "cross_attention_dim": 24,
    "out_channels": 8,  # learned sigma: the pipeline keeps the first four channels
    "attention_bias": True,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000,
    "norm_type": "ada_norm_single",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
}


# --------------------------------------------------------------------------- schedulers and safety checkers


def sd_scheduler(cls, **extra):
    """The Stable Diffusion 1.x / SDXL training schedule, for the sampler class a checkpoint ships."""
    return partial(cls, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, **extra)


def cogvideox_scheduler(snr_shift_scale: float):
    """CogVideoX's DDIM (v-prediction, zero terminal SNR, trailing timesteps), as CogVideoX and CogView3-Plus ship
    it (with their own SNR shift)."""
    return partial(
        CogVideoXDDIMScheduler,
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        timestep_spacing="trailing",
        snr_shift_scale=snr_shift_scale,
    )


#: What the SD-family pipelines are given for their safety checker: none.
NO_SAFETY_CHECKER = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}


# --------------------------------------------------------------------------- calls

#: What most calls share: two denoising steps, 16x16 pixels, tensors out.
IMAGE_CALL = {"prompt": PROMPT, "num_inference_steps": 2, "height": 16, "width": 16, "output_type": "pt"}
NEGATIVE = {"negative_prompt": NEGATIVE_PROMPT}
#: The text length of T5-style encoders.
TEXT_LENGTH = {"max_sequence_length": MAX_SEQUENCE_LENGTH}


def call_generator(seed: int, name: str) -> torch.Generator:
    """A generator for the call input ``name`` (a control image, image embeddings), derived from the call seed as
    a component's seed is from the build seed: each call seed gets other inputs."""
    return torch.Generator().manual_seed(component_seed(seed, name))


def random_image(seed: int, name: str, height: int, width: int | None = None) -> torch.Tensor:
    """A fixed random RGB image in [0, 1], ``(1, 3, height, width)`` (square by default), for the call input
    ``name``: see ``call_generator``."""
    return torch.rand(1, 3, height, width or height, generator=call_generator(seed, name))


def deep_wan_transformer(layers: int = 12) -> torch.nn.Module:
    """A Wan transformer shaped like the released ones where fitting a budget matters: many alike blocks, the
    rest (embeddings, output projection) a small part of the weights — unlike the two-block transformers of the
    tiny pipelines, whose rest is most of them."""
    from diffusers import WanTransformer3DModel

    deep = {"in_channels": 4, "out_channels": 4, "ffn_dim": 96, "num_layers": layers}
    return seeded(configured(WanTransformer3DModel, WAN_TRANSFORMER, deep)).eval()


def deep_wan_inputs(seed: int = 0) -> dict:
    """A call of :func:`deep_wan_transformer`: two latent frames of 8 x 8, eight text tokens."""
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=generator),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
        return_dict=False,
    )
