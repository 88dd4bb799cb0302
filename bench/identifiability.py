"""How anonymous are the arena's battles? A classifier that tells which model wrote an answer.

Reads every battle answer stored in a running arena's stream (each `BattleTurn` links a
turn to its two requests, `BattleStarted` says which model answered each side, the
`ChatCompleted` events hold the text), trains a TF-IDF + logistic-regression classifier
(scikit-learn) on part of them and prints its accuracy on the rest, beside chance, and
the voter's version of the question: given a battle's two answers, which side is model X?
Published work on public arenas identifies models from their answers more than 95% of the
time, which lets a voter find and vote for (or against) one model. Prints figures, asserts
nothing.

    python -m bench.identifiability --url http://127.0.0.1:8000 --play 300   # play 300 battles first (no votes)
    python -m bench.identifiability --nats-url nats://127.0.0.1:4333          # only what is stored
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter

import httpx
import nats
import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.pipeline import make_pipeline, make_union

from events.battles import BATTLES_SUBJECT, BattleStarted, BattleTurn
from events.models import ChatCompleted
from events.subjects import COMPLETED
from infra.settings import OperatorSettings
from runtime import jetstream
from runtime.stream import read_events

PROMPTS = (
    "Once upon a time",
    "Tell me a story about a dog",
    "What is the capital of France?",
    "Write a poem about the sea",
    "Explain how a rainbow forms",
    "Give me three tips for sleeping well",
    "Why is the sky blue?",
    "A little girl found a box",
    "What should I cook tonight?",
    "Describe a cat in one sentence",
)


def play(url: str, battles: int, max_tokens: int, headers: dict) -> None:
    """Battles with one turn each and no vote: answers for the stream, nothing for the board."""
    with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
        for k in range(battles):
            started = client.post("/arena/battles")
            started.raise_for_status()
            bid = started.json()["battle_id"]
            body = {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": max_tokens}
            with client.stream("POST", f"/arena/battles/{bid}/turns", json=body) as r:
                for _ in r.iter_lines():
                    pass


async def stored_answers(nats_url: str) -> tuple[list[str], list[str], list[tuple[int, int]]]:
    """(texts, models, battle pairs as indexes into them) of every completed battle answer."""
    nc = await nats.connect(
        jetstream.servers(nats_url), allow_reconnect=False, **jetstream.connect_options(OperatorSettings())
    )
    try:
        js = nc.jetstream()
        battle_events = await read_events(js, BATTLES_SUBJECT)
        completed = {
            e.request_id: e.text for e in await read_events(js, f"{COMPLETED}.>") if isinstance(e, ChatCompleted)
        }
    finally:
        await nc.close()
    started = {e.battle_id: e for e in battle_events if isinstance(e, BattleStarted)}
    texts, models, pairs = [], [], []
    for turn in (e for e in battle_events if isinstance(e, BattleTurn) and e.battle_id in started):
        battle = started[turn.battle_id]
        if turn.request_a in completed and turn.request_b in completed:
            for rid, model in ((turn.request_a, battle.model_a), (turn.request_b, battle.model_b)):
                texts.append(completed[rid])
                models.append(model)
            pairs.append((len(texts) - 2, len(texts) - 1))
    return texts, models, pairs


def classifier():
    features = make_union(
        TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 4), sublinear_tf=True, min_df=2),
        TfidfVectorizer(analyzer="word", ngram_range=(1, 2), sublinear_tf=True, min_df=2),
    )
    return make_pipeline(features, LogisticRegression(max_iter=2000, C=10.0))


def report(texts: list[str], models: list[str], pairs: list[tuple[int, int]], folds: int, seed: int) -> None:
    y = np.array(models)
    counts = Counter(models)
    folds = min(folds, *counts.values())
    if len(counts) < 2 or folds < 2:
        print(f"  not enough answers: {dict(counts)} (need two models with {max(folds, 2)}+ answers each)")
        return
    cv = StratifiedKFold(folds, shuffle=True, random_state=seed)
    proba = cross_val_predict(classifier(), texts, y, cv=cv, method="predict_proba")
    labels = np.array(sorted(counts))
    predicted = labels[proba.argmax(axis=1)]
    per_model = ", ".join(f"{m} {n}" for m, n in sorted(counts.items()))
    print(f"  answers: {len(texts)} from {len(counts)} models ({per_model})")
    print(f"  which model wrote this answer: accuracy {np.mean(predicted == y):.1%} ({folds}-fold, held out)")
    print(f"    chance (always the most frequent model): {max(counts.values()) / len(texts):.1%}")
    for m in labels:
        mask = y == m
        print(f"    {m:<28} recall {np.mean(predicted[mask] == m):6.1%}")
    # The voter's question: in a battle with model X on one side, which side is it?
    col = {m: k for k, m in enumerate(labels)}
    right = total = 0
    for i, j in pairs:
        if y[i] == y[j]:
            continue
        for target in (y[i], y[j]):
            guess_i = proba[i, col[target]] > proba[j, col[target]]
            right += int(guess_i == (y[i] == target))
            total += 1
    if total:
        print(
            f"  which side of a battle is model X: accuracy {right / total:.1%} over {total // 2} battles (chance 50%)"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="the arena's gateway, to --play battles first")
    ap.add_argument("--play", type=int, default=0, help="battles to play first (one turn, no vote)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default=None, help="when the gateway wants one")
    ap.add_argument("--nats-url", default=None, help="the stream (default: the running arena up's)")
    ap.add_argument("--state-dir", default=OperatorSettings().state_dir)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    url = args.nats_url or OperatorSettings().nats_url
    if not url:
        with open(f"{args.state_dir}/endpoints.json") as f:
            url = json.load(f)["nats_url"]
    if args.play:
        if not args.url:
            ap.error("--play needs --url")
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        play(args.url, args.play, args.max_tokens, headers)
    texts, models, pairs = asyncio.run(stored_answers(url))
    print(f"identifiability: {len(pairs)} battle turns with both answers stored")
    report(texts, models, pairs, args.folds, args.seed)


if __name__ == "__main__":
    main()
