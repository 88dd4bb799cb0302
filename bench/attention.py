"""A decode step's attention on a CPU: one query a row over its cached keys and values,
computed the ways a step can (consumers/inference/engine/packed.py). Prints µs a call, the
median of ``--repeat`` timings of ``--calls`` calls; asserts nothing.

    python -m bench.attention                                  # SmolLM2-135M's shapes, bfloat16
    python -m bench.attention --rows 1,32 --columns 400 --dtype float32 --threads 2

- ``enable_gqa``: SDPA on the query heads with the key/value heads shared
  (``enable_gqa=True``), what transformers calls when the step has no mask (one
  request alone, or rows of one length) and what a packed step's running rows called;
- ``repeat``: the key/value heads copied to every query head first (``repeat_kv``);
- ``one query``: the engine's (``packed.one_query_attention``): each group of query heads
  that share a key/value head attends as that head's queries; ``+ mask``: with the
  padding mask a batch of rows of different lengths carries.

Keys and values are views of a wider buffer, as the engine's KV slab hands them over.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from consumers.inference.engine.packed import one_query_attention


def timed(call, calls: int, repeat: int) -> float:
    """Median µs a call."""
    for _ in range(3):
        call()
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def ways(rows: int, columns: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> dict:
    keys = torch.randn(rows, kv_heads, columns + 64, dim, dtype=dtype)[:, :, :columns]
    values = torch.randn(rows, kv_heads, columns + 64, dim, dtype=dtype)[:, :, :columns]
    query = torch.randn(rows, heads, 1, dim, dtype=dtype)
    mask = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    mask[1::2, :, :, : columns // 4] = False  # every other row shorter, left-padded
    groups = heads // kv_heads
    return {
        "enable_gqa": lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True),
        "repeat": lambda: F.scaled_dot_product_attention(
            query, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        ),
        "one query": lambda: one_query_attention(query, keys, values, None, None),
        "one query + mask": lambda: one_query_attention(query, keys, values, mask, None),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--columns", default="170,400", help="cached tokens a row attends over")
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads (SmolLM2-135M: 3)")
    parser.add_argument("--dim", type=int, default=64, help="head dimension (SmolLM2-135M: 64)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, {args.heads} query heads on "
        f"{args.kv_heads} key/value heads of {args.dim}; µs a call (median of {args.repeat} x {args.calls})"
    )
    names = list(ways(1, 8, args.heads, args.kv_heads, args.dim, dtype))
    print(f"{'rows':>5} {'columns':>8} " + " ".join(f"{n:>17}" for n in names) + "   enable_gqa / one query")
    for rows in (int(r) for r in args.rows.split(",")):
        for columns in (int(c) for c in args.columns.split(",")):
            us = {
                n: timed(f, args.calls, args.repeat)
                for n, f in ways(rows, columns, args.heads, args.kv_heads, args.dim, dtype).items()
            }
            print(
                f"{rows:>5} {columns:>8} "
                + " ".join(f"{us[n]:>17.0f}" for n in names)
                + f"   {us['enable_gqa'] / us['one query']:.1f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
