"""Benchmark workloads: synthetic generators with fixed seeds, and a JSONL loader.

A workload is a list of `Session`s. A session is a conversation of one or more turns; a plain
request is a session of one turn. Multi-turn sessions send their turns one after another and put
the server's real replies into the history, so prefix caching sees what it would see in use.

Lengths are drawn in *words* from a list of common English words that are one token each in the
SmolLM2 (GPT-2 style BPE) tokenizer, so a prompt of W words is close to W tokens there. The
benchmark never trusts these estimates for its figures: token counts come from the server's
`usage`. The distributions are documented in docs/bench.md; keep the two in step.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

# Common words, each a single token (with its leading space) in GPT-2 style vocabularies. Varied
# enough that prompts do not compress into repeats, plain enough that any tokenizer agrees.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this are had not be "
    "but have one all were when we there can an which their said if do will each about how up "
    "out them then she many some so these would other into has more two like him time see no "
    "could way people my than first water been who now find long down day did get come made may "
    "part over new after also back use good man just very work life our only year under name "
    "know great where help through much before line right too mean old any same tell boy follow "
    "came want show around form three small set put end does another well large must big even "
    "such because turn here why ask went men read need land different home us move try kind hand "
    "picture again change off play spell air away animal house point page letter mother answer "
    "found study still learn should world high every near add food between own below country "
    "plant last school father keep tree never start city earth eye light thought head under story "
    "saw left few while along might close something seem next hard open example begin river "
    "together group often run important until children side feet car mile night walk white sea "
    "began grow took carry state once book hear stop without second later miss idea enough eat "
    "face watch far real almost let above girl sometimes mountain cut young talk soon list song "
    "being leave family body music color stand sun question fish area mark dog horse birds problem"
).split()

# Openers for questions about a text; they keep synthetic prompts looking like requests.
_ASKS = (
    "Summarize the text above in a few sentences.",
    "What is the main point of the text above?",
    "List three facts from the text above.",
    "Explain the text above to a child.",
    "Write a short title for the text above.",
)


@dataclass
class Turn:
    """One request: the user's text and how many tokens to ask for."""

    text: str
    max_tokens: int


@dataclass
class Session:
    """A conversation sent in order; `tag` groups requests in the report (e.g. interference)."""

    id: int
    turns: list[Turn]
    system: str | None = None
    tag: str = "all"
    # Messages sent as they stand before the first turn (JSONL `messages`); None for synthetic.
    preset: list[dict] | None = field(default=None)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A length drawn log-normally (median, sigma of the log) and clipped to [lo, hi].

    Log-normal because measured prompt and reply lengths of chat traffic are right-skewed with a
    long tail; clipping keeps one unlucky draw from exceeding the model's context.
    """
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def words(rng: random.Random, n: int, sentences: bool = True) -> str:
    """n words of filler text, with a full stop every 8-15 words so it reads as sentences.

    The stops add about 9% tokens (measured: 1000 words -> ~1090 SmolLM2 tokens); without them
    (sentences=False) n words are n tokens, give or take the first one.
    """
    if not sentences:
        return " ".join(rng.choice(WORDS) for _ in range(n))
    out: list[str] = []
    until_stop = rng.randint(8, 15)
    for i in range(n):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        until_stop -= 1
        if until_stop == 0 and i != n - 1:
            out[-1] += "."
            until_stop = rng.randint(8, 15)
    return " ".join(out) + "." if out else ""


def _out_len(
    rng: random.Random, max_tokens: int | None, median: float, sigma: float, lo: int, hi: int
) -> int:
    # --max-tokens fixes every request's budget; otherwise the workload's own distribution.
    return max_tokens if max_tokens else _lognormal_int(rng, median, sigma, lo, hi)


def chat(n: int, rng: random.Random, max_tokens: int | None) -> list[Session]:
    """Single-turn chat: prompt median 120 words (sigma 0.8, 8-1024), reply median 128 (0.6, 16-512)."""
    out = []
    for i in range(n):
        p = _lognormal_int(rng, 120, 0.8, 8, 1024)
        out.append(Session(i, [Turn(words(rng, p), _out_len(rng, max_tokens, 128, 0.6, 16, 512))]))
    return out


def multiturn(n: int, rng: random.Random, max_tokens: int | None) -> list[Session]:
    """Conversations of 2-6 turns (uniform); each user turn median 40 words (0.7, 4-400), reply
    median 96 (0.6, 16-384); a shared-per-conversation system prompt of 20-60 words.

    The total number of turns is exactly n: the last conversation is cut short if needed.
    """
    out: list[Session] = []
    left = n
    while left > 0:
        k = min(left, rng.randint(2, 6))
        turns = [
            Turn(
                words(rng, _lognormal_int(rng, 40, 0.7, 4, 400)), _out_len(rng, max_tokens, 96, 0.6, 16, 384)
            )
            for _ in range(k)
        ]
        out.append(Session(len(out), turns, system=words(rng, rng.randint(20, 60))))
        left -= k
    return out


def longdoc(n: int, rng: random.Random, max_tokens: int | None) -> list[Session]:
    """A long document then a question: document median 1500 words (0.5, 512-6000), reply median
    64 (0.5, 16-256). Prefill-heavy; 6000 words stays inside an 8k context with the reply."""
    out = []
    for i in range(n):
        doc = words(rng, _lognormal_int(rng, 1500, 0.5, 512, 6000))
        out.append(
            Session(i, [Turn(doc + "\n\n" + rng.choice(_ASKS), _out_len(rng, max_tokens, 64, 0.5, 16, 256))])
        )
    return out


def shared_prefix(
    n: int, rng: random.Random, max_tokens: int | None, num_prefixes: int = 4, prefix_words: int = 800
) -> list[Session]:
    """Few long system prompts shared by many short questions, as behind an assistant product:
    4 system prompts of 800 words; each request picks one (uniform) and asks a question of median
    30 words (0.6, 4-200); reply median 64 (0.5, 16-256). Measures prefix-cache reuse."""
    prefixes = [words(rng, prefix_words) for _ in range(num_prefixes)]
    out = []
    for i in range(n):
        q = words(rng, _lognormal_int(rng, 30, 0.6, 4, 200))
        out.append(
            Session(i, [Turn(q, _out_len(rng, max_tokens, 64, 0.5, 16, 256))], system=rng.choice(prefixes))
        )
    return out


def interference(
    n: int, rng: random.Random, max_tokens: int | None, long_fraction: float = 0.2
) -> list[Session]:
    """Decode-heavy requests mixed with prefill-heavy ones, tagged so the report splits them.

    80% `decode`: prompt median 32 words (0.5, 8-128), reply 256 tokens; 20% `prefill`: prompt
    median 2000 words (0.3, 1024-4000), reply 16 tokens. In a colocated server the long prefills
    stall the decoders' streams; the `decode` class's TPOT/ITL tails show how much. --max-tokens
    overrides only the decode class, whose replies are the thing being observed.
    """
    out = []
    for i in range(n):
        if rng.random() < long_fraction:
            p = _lognormal_int(rng, 2000, 0.3, 1024, 4000)
            out.append(Session(i, [Turn(words(rng, p), 16)], tag="prefill"))
        else:
            p = _lognormal_int(rng, 32, 0.5, 8, 128)
            out.append(Session(i, [Turn(words(rng, p), max_tokens or 256)], tag="decode"))
    return out


def fixed(n: int, rng: random.Random, max_tokens: int | None, input_len: int = 128) -> list[Session]:
    """Every prompt input_len words, every reply max_tokens (default 128): the shape used to
    compare systems side by side, where equal work per request matters more than realism."""
    # No full stops, so input_len words are input_len tokens for SmolLM2's tokenizer.
    return [Session(i, [Turn(words(rng, input_len, sentences=False), max_tokens or 128)]) for i in range(n)]


SYNTHETIC = {
    "chat": chat,
    "multiturn": multiturn,
    "longdoc": longdoc,
    "shared-prefix": shared_prefix,
    "interference": interference,
    "fixed": fixed,
}


def load_jsonl(
    path: str | Path, n: int, max_tokens: int | None, default_max_tokens: int = 128
) -> list[Session]:
    """Sessions from a JSONL file; the file is cycled when it has fewer lines than n requests.

    Each line is one of:
      {"prompt": "...", "max_tokens"?: int}                      one user turn
      {"messages": [{"role":..., "content":...}, ...], "max_tokens"?: int}   sent as given
      {"turns": ["...", ...], "system"?: "...", "max_tokens"?: int}  a conversation whose
                                                                       replies come from the server
    An optional "tag" groups lines in the report. Request count n counts turns, as for synthetic
    multi-turn workloads, so a conversation may be cut short to make exactly n.
    """
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    out: list[Session] = []
    left, i = n, 0
    while left > 0:
        row = rows[i % len(rows)]
        i += 1
        mt = max_tokens or int(row.get("max_tokens", default_max_tokens))
        tag = str(row.get("tag", "all"))
        if "turns" in row:
            texts = [str(t) for t in row["turns"]][:left]
            s = Session(len(out), [Turn(t, mt) for t in texts], system=row.get("system"), tag=tag)
        elif "messages" in row:
            # The last message is the user's; earlier ones are history sent unchanged.
            msgs = list(row["messages"])
            if not msgs or msgs[-1].get("role") != "user":
                raise ValueError(f"{path}: a 'messages' line must end with a user message")
            s = Session(len(out), [Turn(str(msgs[-1]["content"]), mt)], tag=tag, preset=msgs[:-1])
        elif "prompt" in row:
            s = Session(len(out), [Turn(str(row["prompt"]), mt)], tag=tag)
        else:
            raise ValueError(f"{path}: each line needs 'prompt', 'messages' or 'turns'")
        if not s.turns:
            continue
        out.append(s)
        left -= len(s.turns)
    return out


def make_workload(
    name: str, n: int, seed: int = 0, max_tokens: int | None = None, input_len: int = 128
) -> list[Session]:
    """The sessions for `name` (a synthetic workload or a .jsonl path), n requests in total."""
    if n <= 0:
        raise ValueError("the number of requests must be positive")
    if name in SYNTHETIC:
        # One RNG per workload, seeded from (name, seed): the same flags give the same prompts.
        rng = random.Random(f"{name}:{seed}")
        if name == "fixed":
            return fixed(n, rng, max_tokens, input_len)
        return SYNTHETIC[name](n, rng, max_tokens)
    if name.endswith(".jsonl") or Path(name).is_file():
        return load_jsonl(name, n, max_tokens)
    raise ValueError(f"unknown workload {name!r}: one of {', '.join(SYNTHETIC)} or a .jsonl file")


def count_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)
