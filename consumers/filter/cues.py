"""Hand-written cues of an attack, as a small dense vector (the classifier's second view).

The n-gram model learns the *style* of the attack collections it trained on, and
a collection it never saw looks like none of them. These cues name what attacks
have in common whatever their style, written down from the published taxonomies
of harm and of prompt injection, not fitted to any collection:

* a harmful request: words of the usual harm categories (violence, cybercrime,
  fraud, drugs, hate, self-harm, sexual content, misinformation, privacy), alone
  and together with a request verb in one sentence;
* an instruction aimed at the model: override ("ignore", "previous instructions",
  "unrestricted"), secrets ("system prompt", "password"), persona and fiction
  framing, compliance pressure ("never refuse", "disclaimer"), output coercion,
  encodings ("decode", "base64", "reversed");
* a few phrase patterns ("from now on", "sure, here is", "you are now"...) and the
  text's shape (length, scripts, an embedded base64 run, and the rules' adversarial
  suffix signals as numbers: odd glued word fragments and unbalanced brackets at
  the end of the last line).

Word categories are densities (count / sqrt(words)), so a long benign document does
not score by length alone, plus the maximum in any one sentence, so one injected
sentence in a long e-mail still counts. The weights are learned at training
(train.py); only the vocabulary is fixed here, and changing it must bump
``CUES_VERSION``. Cost: one translate/split pass over the text's UTF-8 bytes for the
words, a dictionary look-up per word, a few gated phrase searches; about a quarter of a
millisecond at 4,000 characters on one core of the shared box.
"""

from __future__ import annotations

import math
import re

import numpy as np

from consumers.filter.scoring import suffix_shape

__all__ = ["CUES_VERSION", "CUE_NAMES", "cue_tokens", "cue_vector"]

CUES_VERSION = "cues-2"  # cues-2: the suffix shape (share of odd words, unbalanced brackets)

_CATEGORIES: dict[str, str] = {
    "harm_violence": (
        "kill killing killed murder murdering assassinate bomb bombs bombing explosive explosives detonate "
        "detonator weapon weapons gun guns firearm firearms shoot shooting assault torture terror terrorist "
        "terrorism kidnap kidnapping poison poisoning massacre genocide behead stab stabbing arson sabotage "
        "grenade ammunition nerve"
    ),
    "harm_cyber": (
        "hack hacking hacker hackers hacked malware ransomware virus viruses trojan keylogger rootkit botnet ddos "
        "exploit exploits exploiting phishing breach breaching infiltrate spyware backdoor brute-force crack "
        "cracking bypassing sql-injection zero-day payload"
    ),
    "harm_crime": (
        "fraud fraudulent scam scams scammer counterfeit launder laundering steal stealing stolen theft thief "
        "illegal illegally smuggle smuggling bribe bribery blackmail extort extortion ponzi forge forged forgery "
        "evade evasion shoplift shoplifting embezzle trafficking traffickers cheat cheating loot robbery rob "
        "burglary pirate piracy insider"
    ),
    "harm_drugs": "drug drugs cocaine heroin meth methamphetamine fentanyl narcotics opioid opioids lsd mdma overdose",
    "harm_hate": (
        "racist racism hate hateful slur slurs inferior harass harassment harassing bully bullying cyberbully "
        "cyberbullying stalk stalking discriminate discrimination discriminatory xenophobic sexist misogynistic "
        "degrade demean dehumanize supremacy extremist extremism radicalize toxic offensive insult insulting negative"
    ),
    "harm_self": "suicide suicidal self-harm selfharm anorexia bulimia starve cutting",
    "harm_sex": "porn pornography pornographic explicit sexual sexually nude nudes seduce erotic prostitution",
    "harm_misinfo": (
        "misinformation disinformation propaganda conspiracy manipulate manipulation manipulative deceive "
        "deceptive mislead misleading hoax fake rumor rumors defame defamatory libel"
    ),
    "harm_privacy": (
        "dox doxx doxxing surveillance spy spying track tracking personal confidential sensitive private "
        "credentials ssn"
    ),
    "harm_generic": (
        "harmful harm dangerous malicious unethical immoral illicit criminal crime crimes victim victims violent "
        "violence abuse abusive exploit destroy destruction"
    ),
    "inj_override": (
        "ignore ignoring disregard forget override overriding bypass circumvent instead previous prior preceding "
        "above earlier original instructions instruction rules guidelines restrictions restriction constraints "
        "filters filter policies censorship censored unrestricted unfiltered uncensored jailbreak jailbroken "
        "jailbreaking limitations limits boundaries programming directives"
    ),
    "inj_secret": (
        "secret secrets password passwords passphrase confidential reveal revealing leak disclose hidden verbatim "
        "repeat recite initial prompt prompts system key keys token"
    ),
    "inj_model": "you your yourself you're you'll ai assistant model chatgpt gpt llm chatbot bot",
    "inj_persona": (
        "pretend roleplay role-play role character characters persona act acting imagine simulate simulation game "
        "story fictional hypothetical hypothetically fiction scenario dream layer universe villain evil"
    ),
    "inj_compliance": (
        "sure certainly must always never comply obey refuse refusal refusing apologize apologies sorry disclaimer "
        "disclaimers warning warnings ethical ethics moral morals morality legal legality consequences regardless "
        "whatever anything"
    ),
    "inj_output": "print say output respond reply answer write type display only exactly start begin response",
    "inj_encoding": (
        "decode decoding encode encoded encoding base64 cipher ciphertext reverse reversed rot13 morse ascii hex "
        "hexadecimal unicode translate translation translated encrypt decrypt"
    ),
    "inj_now": "now henceforth onwards anymore new mode enabled activated enable unlocked",
    "benign_task": (
        "calculate solve equation explain summarize summary compare difference example function code python java "
        "implement list describe recipe poem essay translate how what why which"
    ),
}
# Verbs that make a sentence a request; with a harm word in the same sentence: a harmful request.
_REQUEST_WORDS = (
    "write create explain tell give provide describe develop generate design teach show list outline produce "
    "draft compose make build craft suggest share detail instruct"
)
_REQUEST = frozenset(_REQUEST_WORDS.split())
# Per-sentence maxima are kept for these categories (the cues an injected sentence carries).
_SENTENCE_CATS = ("inj_override", "inj_secret", "inj_output", "inj_encoding", "inj_compliance")
# Each phrase is a few patterns that start with a literal word: Python's re then
# finds candidates by a fast prefix scan instead of trying every position (a
# leading \\b or alternation costs 50-100 us per pattern at 4,000 characters).
_PHRASES: dict[str, tuple[str, ...]] = {
    "ignore_previous": tuple(
        rf"{verb}\W+(?:\w+\W+){{0,4}}?(?:previous|prior|above|earlier|all|any|your|the)\b"
        for verb in ("ignore", "disregard", "forget", "override")
    ),
    "you_are_now": (r"you (?:are|will be|will now be|shall be) (?:now|a|an|no longer|free|not)\b",),
    "from_now_on": ("from now on", "for the rest of the conversation", "for the rest of this conversation"),
    "sure_here_is": tuple(rf"{w}[,!]? here(?:'s| is| are)\b" for w in ("sure", "certainly", "absolutely")),
    "step_n": (r"step \d\b",),
    "system_prompt": tuple(
        rf"{w} (?:prompt|instructions?|message|password)\b"
        for w in ("system", "initial", "original", "hidden", "secret")
    ),
    "how_to": (
        "how to ",
        "how do i ",
        "how can i ",
        "ways to ",
        "steps to ",
        "guide on ",
        "guide to ",
        "tutorial on ",
        r"instructions (?:on|for) ",
    ),
    "step_by_step": (r"step[- ]by[- ]step", r"detailed (?:plan|guide|instructions)"),
    "write_a": (r"write (?:a|one|an)\b",),
    "do_not_refuse": tuple(
        rf"{w} (?:refuse|mention|warn|apologi|include|add|say|reveal|tell)"
        for w in ("do not", "don't", "never", "without")
    ),
    "act_as": ("act as ", "i want you to ", "you will act", "you are going to "),
    "say_quote": tuple(
        rf"{w}\W{{0,3}}[\"'“]" for w in ("say", "print", "output", "respond with", "reply with", "write")
    ),
    "new_instructions": tuple(
        rf"{w} (?:instructions?|task|rules|directive)\b"
        for w in ("new", "updated", "additional", "real", "actual", "true")
    ),
    "code_call": (r"\.append\(", r"decode\(", r"def \w+\("),
    "educational": ("educational purposes", "research purposes", r"purely (?:hypothetical|fictional)"),
    "the_following": tuple(
        rf"{w} (?:sentence|text|instruction|code|passage|email|message)\b" for w in ("the following", "below", "above")
    ),
}
_SHAPE = (
    "log_chars",
    "log_words",
    "non_ascii",
    "scripts",
    "base64_run",
    "upper",
    "lines",
    "questions",
    "you_density",
    "symbols",
    "suffix_odd",
    "suffix_unbalanced",
)
CUE_NAMES: tuple[str, ...] = (
    *(f"density:{c}" for c in _CATEGORIES),
    "sentence:harm",
    "sentence:harmful_request",
    *(f"sentence:{c}" for c in _SENTENCE_CATS),
    "harm_sentence_share",
    *(f"phrase:{p}" for p in _PHRASES),
    *(f"shape:{s}" for s in _SHAPE),
)

_CAT_INDEX = {c: i for i, c in enumerate(_CATEGORIES)}
_REQ = -1  # marks a request verb in the lexicon
_LEXICON: dict[str, tuple[int, ...]] = {}
for _i, _vocab in enumerate(_CATEGORIES.values()):
    for _w in _vocab.split():
        _LEXICON[_w] = (*_LEXICON.get(_w, ()), _i)
for _w in _REQUEST:
    _LEXICON[_w] = (*_LEXICON.get(_w, ()), _REQ)
_END: tuple[int, ...] = ()  # a sentence end; compared by identity
for _e in ".!?\n":
    _LEXICON[_e] = _END
_HARM = frozenset(i for c, i in _CAT_INDEX.items() if c.startswith("harm_"))
_SENT_POS = {_CAT_INDEX[c]: k for k, c in enumerate(_SENTENCE_CATS)}


def _plan(ids: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """What one lexicon word does: categories to count, sentence slots to bump, is it a request verb."""
    cats = tuple(i for i in ids if i != _REQ)
    slots = tuple(len(_SENTENCE_CATS) if i in _HARM else _SENT_POS[i] for i in cats if i in _HARM or i in _SENT_POS)
    return cats, slots, _REQ in ids


_END_PLAN = ((), (), False)  # a sentence end; compared by identity
# keyed by bytes: the tokens are cut from the UTF-8 bytes of the text (_tokens)
_PLANS = {w.encode(): _END_PLAN if ids is _END else _plan(ids) for w, ids in _LEXICON.items()}
_YOU = _CAT_INDEX["inj_model"]
# Tokens are the matches of r"[a-z][a-z'\-]*|[.!?]" (words, and sentence ends on their own,
# all three read as "."), cut without a regex from the UTF-8 bytes: translate() blanks every
# other byte (those of non-ASCII characters too) and split() does the rest, at about two
# thirds of re.findall's cost.
_TOKEN_BYTES = bytes(
    c if chr(c) in "abcdefghijklmnopqrstuvwxyz'-." else ord(".") if chr(c) in "!?" else ord(" ") for c in range(256)
)
_LEADING_RUN = re.compile(rb" [-']+")  # a word starts at a letter: quotes and hyphens before it are not part of it


def _tokens(data: bytes) -> list[bytes]:
    """The words and sentence ends of ``data`` (the text as UTF-8), in order."""
    text = b" " + data.translate(_TOKEN_BYTES)
    if b"." in text:
        text = text.replace(b".", b" . ")
    if b" '" in text or b" -" in text:
        # one quote or hyphen before a word is common ("- item"), a run of them rare
        text = text.replace(b" '", b"  ").replace(b" -", b"  ")
        if b" '" in text or b" -" in text:
            text = _LEADING_RUN.sub(b" ", text)
    return text.split()


def _gate(pattern: str) -> str:
    """The literal text every match of ``pattern`` starts with (a substring test is ~1 us)."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():  # an escaped literal
            out.append(pattern[i + 1])
            i += 2
        elif ch in "\\[](){}?*+|^$.":
            break
        else:
            out.append(ch)
            i += 1
    # a quantifier applies to the character before it, which is then not certain
    return "".join(out[:-1] if i < len(pattern) and pattern[i] in "?*{" else out)


_FIRST_WORD = re.compile(r"[a-z][a-z'\-]*")


def _key(gate: str) -> str:
    """The first word of a gate: a phrase can only match where that word is one of the tokens."""
    m = _FIRST_WORD.search(gate)
    return m.group(0) if m else ""


# (first word, literal start, pattern, phrase index, must start a word); then grouped by first word
_PHRASE_RE = [
    (_key(_gate(p)).encode(), _gate(p).encode(), re.compile(p), k, p[0].isalpha())
    for k, patterns in enumerate(_PHRASES.values())
    for p in patterns
]
_PHRASE_BY_KEY: dict[bytes, list[tuple[bytes, re.Pattern[str], int, bool]]] = {}
for _key_word, _literal, _pattern, _k, _word_start in _PHRASE_RE:
    _PHRASE_BY_KEY.setdefault(_key_word, []).append((_literal, _pattern, _k, _word_start))
_PHRASE_KEYS = frozenset(_PHRASE_BY_KEY)
_UPPER = bytes(range(ord("A"), ord("Z") + 1))
_PUNCT = b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
# base64 alphabet -> "A", anything else -> " ": a run of 24 "A" is a base64-looking run
_BASE64_MAP = bytes(
    ord("A") if chr(c).isascii() and (chr(c).isalnum() or chr(c) in "+/") else ord(" ") for c in range(256)
)
_BASE64_RUN = b"A" * 24
_SHAPE_CHARS = 4000


def _words(tokens: list[bytes]) -> tuple[list[int], list[int], float, float]:
    """Category counts, per-sentence maxima, harm sentence share and the word count."""
    # only the tokens the lexicon knows (about one in six) reach the Python loop below
    hits = [plan for plan in map(_PLANS.get, tokens) if plan is not None]
    counts = [0] * len(_CATEGORIES)
    sent_max = [0] * (len(_SENTENCE_CATS) + 2)  # harm, harmful request, then _SENTENCE_CATS
    sent = [0] * (len(_SENTENCE_CATS) + 1)  # the current sentence: _SENTENCE_CATS, then harm
    request = False
    ends = sentences = harm_sentences = 0
    for plan in hits:
        if plan is _END_PLAN:
            ends += 1
            if any(sent):
                sentences += 1
                harm_sentences += sent[-1] > 0
                sent_max = _close_sentence(sent_max, sent, request)
                sent = [0] * len(sent)
            request = False
            continue
        cats, slots, is_request = plan
        for i in cats:
            counts[i] += 1
        for j in slots:
            sent[j] += 1
        request = request or is_request
    if any(sent):
        sentences += 1
        harm_sentences += sent[-1] > 0
        sent_max = _close_sentence(sent_max, sent, request)
    return counts, sent_max, harm_sentences / max(sentences, 1), float(len(tokens) - ends)


def _close_sentence(sent_max: list[int], sent: list[int], request: bool) -> list[int]:
    harm = sent[-1]
    current = [harm, harm if request else 0, *sent[:-1]]
    return [max(a, b) for a, b in zip(sent_max, current, strict=True)]


def _shape(original: str, words: float, you: int) -> list[float]:
    head = original[:_SHAPE_CHARS]
    n = max(len(head), 1)
    # byte-level translate and substring search: several times faster than regex scans
    ascii_ = head.encode("ascii", "ignore")
    scripts = 1
    if len(ascii_) < len(head):  # rare: only then pay for the code point array
        cps = np.frombuffer(head.encode("utf-32-le"), dtype=np.uint32)
        scripts = len(np.unique(cps[cps >= 0x250] >> 7)) + 1
    return [
        math.log1p(len(original)),
        math.log1p(words),
        (len(head) - len(ascii_)) / n,
        float(min(scripts, 5)),
        float(_BASE64_RUN in ascii_.translate(_BASE64_MAP)),
        (len(ascii_) - len(ascii_.translate(None, _UPPER))) / n,
        math.log1p(original.count("\n")),
        math.log1p(original.count("?")),
        you / max(words, 1.0),
        (len(ascii_) - len(ascii_.translate(None, _PUNCT))) / n,
        *suffix_shape(original),
    ]


def cue_tokens(norm: str) -> list[bytes]:
    """The words and sentence ends of the classifier's normalized text (ASCII words only)."""
    return _tokens(norm.encode())


def cue_vector(norm: str, original: str, cut: list[bytes] | None = None) -> np.ndarray:
    """The cues of one prompt (float64, ``len(CUE_NAMES)``).

    ``norm`` is the classifier's normalized text (features.normalize: skeleton,
    lower case, whitespace collapsed); ``original`` the prompt as sent; and
    ``cut``, its :func:`cue_tokens` when already cut.
    """
    data = norm.encode()
    tokens = _tokens(data) if cut is None else cut
    counts, sent_max, harm_share, words = _words(tokens)
    root = math.sqrt(max(words, 1.0))
    found = [0] * len(_PHRASES)
    # the phrases whose first word is a token: a set intersection, not a substring scan per phrase;
    # then a test of the literal start on the UTF-8 bytes (a fraction of a microsecond; the same
    # answer as on the text, since UTF-8 is self-synchronizing) before the regex scan of the text
    for key in _PHRASE_KEYS.intersection(tokens):
        for literal, pattern, k, word_start in _PHRASE_BY_KEY[key]:
            if literal not in data:
                continue
            found[k] += sum(
                1
                for m in pattern.finditer(norm)
                if not word_start or m.start() == 0 or not norm[m.start() - 1].isalnum()
            )
    phrases = [math.log1p(v) for v in found]
    return np.array(
        [
            *(c / root for c in counts),
            *(math.log1p(v) for v in sent_max),
            harm_share,
            *phrases,
            *_shape(original, words, counts[_YOU]),
        ],
        dtype=np.float64,
    )
