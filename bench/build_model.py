"""Build a random-initialized Llama of a chosen size, with a BPE tokenizer, locally.

Throughput does not depend on what the weights say, so a random model of the right
shape is a fair stand-in for a trained one, and it needs no download. The tokenizer is
a byte-level BPE trained on docstrings of Python's own standard library, so any text
(the Chinese Locust prompt included) encodes.

    python -m bench.build_model --size 60m --out .arena/models/llama-60m
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

# Special tokens, in id order: ids 0..3 in every model this module builds.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"

# A plain chat format, so chat-completions servers (transformers serve, arenaflow)
# can render messages; the tokens in it are ordinary BPE text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """Llama shape; `vocab` is the BPE target (the trainer may stop below it)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


SIZES: dict[str, ModelSize] = {
    # ~0.3M: for tests that only need a model that loads and generates.
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=172, vocab=1000),
    "20m": ModelSize(hidden=384, layers=6, heads=6, kv_heads=6, intermediate=1024, vocab=16000),
    # ~58M with untied embeddings: the default benchmark model.
    "60m": ModelSize(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1408, vocab=32000),
}


def corpus_lines(max_chars: int) -> list[str]:
    """Standard-library docstrings, then source text, in a stable order, up to `max_chars`.

    Docstrings alone stop the BPE short of a 32k vocabulary, so source follows them.
    """
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # its import prints the Zen; the text is rot13 in `this.s`

    lines = [codecs.decode(this.s, "rot13")]
    total = len(lines[0])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    lines.append(doc)
                    total += len(doc)
        if total >= max_chars:
            return lines
    for path in sorted(stdlib.rglob("*.py")):
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        lines.append(text)
        total += len(text)
    return lines


def build_tokenizer(vocab_size: int, max_chars: int | None = None):
    """Train a byte-level BPE and wrap it as a PreTrainedTokenizerFast."""
    max_chars = max_chars or max(300_000, vocab_size * 400)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(max_chars), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    return fast


def build_model(size: ModelSize, vocab_size: int, seed: int = 0):
    """A random LlamaForCausalLM whose EOS is never the greedy choice.

    The EOS row of the (untied) output head is zeroed: its logit is then 0 while the
    largest of the other random logits is well above 0, so greedy decoding runs to
    `max_tokens` and output lengths stay under the workload's control.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id].zero_()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3, do_sample=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="60m")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    size = SIZES[args.size]
    tokenizer = build_tokenizer(size.vocab)
    vocab_size = len(tokenizer)
    model = build_model(size, vocab_size, seed=args.seed)
    params = sum(p.numel() for p in model.parameters())

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    info = {"size": args.size, "params": params, "vocab_size": vocab_size, **asdict(size)}
    (args.out / "bench_model.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"built {args.size} Llama: {params / 1e6:.1f}M parameters, vocab {vocab_size} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
