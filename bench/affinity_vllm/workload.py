"""The workload of the real-engine leg, as the SGLang generated-shared-prefix benchmark builds it:
SYSTEM_PROMPTS system prompts of exactly SYSTEM_TOKENS tokens of the engines' tokenizer (whole KV
blocks), each request one of them drawn Zipf(ZIPF_S) with the popularity rank shuffled, plus a
user turn of USER_TOKENS tokens no other request has; open-loop Poisson arrivals. Seeded: the
same seed gives the same prompts, the same request sequence and, at a given rate, the same
arrival times; at another rate the same sequence with its gaps scaled."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

SYSTEM_PROMPTS = 16
SYSTEM_TOKENS = 896  # 7 blocks of 128
BLOCK_TOKENS = 128
USER_TOKENS = 64
ZIPF_S = 0.6
SERVED_MODEL = "tiny"

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


class WorkloadError(RuntimeError):
    pass


@dataclass(frozen=True)
class Tokenizer:
    """What the workload needs of a tokenizer: text -> ids (no special tokens), ids -> text, and
    the ids that decode to one whole word (the words the prompts are drawn from)."""
    encode: Encode
    decode: Decode
    word_ids: tuple[int, ...]


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The model's own tokenizer (tokenizer.json); words are its vocabulary entries that are a
    space and letters (byte-level BPE writes the space as "Ġ")."""
    from tokenizers import Tokenizer as HfTokenizer

    tokenizer = HfTokenizer.from_file(str(model_dir / "tokenizer.json"))
    words = tuple(sorted(i for token, i in tokenizer.get_vocab().items()
                         if token.startswith("Ġ") and len(token) > 2 and token[1:].isalpha()))
    if len(words) < 20:
        raise WorkloadError(f"{model_dir}: only {len(words)} whole-word tokens to draw prompts from")
    return Tokenizer(lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                     lambda ids: tokenizer.decode(ids), words)


def exact_text(tokenizer: Tokenizer, lead: str, rng: random.Random, tokens: int) -> str:
    """`lead` and then drawn words, cut to a text that the tokenizer makes exactly `tokens` tokens
    of. Cutting the ids and decoding may re-tokenize differently at the cut, so cuts near the
    target are tried until one holds."""
    ids = tokenizer.encode(lead)
    ids += [rng.choice(tokenizer.word_ids) for _ in range(tokens + 16)]
    for offset in range(16):
        for cut in dict.fromkeys((tokens - offset, tokens + offset)):
            if 0 < cut <= len(ids):
                text = tokenizer.decode(ids[:cut])
                if len(tokenizer.encode(text)) == tokens:
                    return text
    raise WorkloadError(f"no cut of {lead!r}... makes exactly {tokens} tokens")


def system_prompts(tokenizer: Tokenizer, seed: int, count: int = SYSTEM_PROMPTS,
                   tokens: int = SYSTEM_TOKENS) -> list[str]:
    """`count` system prompts of exactly `tokens` tokens; the index leads each, so two prompts
    differ from their first token on (and so from their first KV block)."""
    rng = random.Random(f"system prompts {seed}")
    return [exact_text(tokenizer, f"System prompt {i}:", rng, tokens) for i in range(count)]


@dataclass(frozen=True)
class Planned:
    """One request: its arrival at unit rate (divide by the rate in requests/s for seconds),
    its system prompt's index and its user turn."""
    unit_at: float
    system: int
    user: str


def zipf_weights(count: int, s: float) -> list[float]:
    return [1.0 / rank ** s for rank in range(1, count + 1)]


def plan(tokenizer: Tokenizer, seed: int, requests: int, prompts: int = SYSTEM_PROMPTS,
         s: float = ZIPF_S, user_tokens: int = USER_TOKENS) -> list[Planned]:
    """The seeded request sequence: Poisson arrivals at rate 1 (exponential gaps), a system
    prompt drawn Zipf(s) by a shuffled popularity rank (prompt 0 is not always the hot one), a
    user turn of exactly `user_tokens` tokens led by the request's number."""
    rng = random.Random(f"plan {seed}")
    by_rank = list(range(prompts))
    rng.shuffle(by_rank)
    weights = zipf_weights(prompts, s)
    planned, t = [], 0.0
    for n in range(requests):
        t += rng.expovariate(1.0)
        system = rng.choices(by_rank, weights)[0]
        planned.append(Planned(t, system, exact_text(tokenizer, f"Request {n}:", rng, user_tokens)))
    return planned


def body(request: Planned, prompts: Sequence[str], max_tokens: int) -> dict[str, Any]:
    """A streaming chat that decodes exactly `max_tokens` tokens (ignore_eos)."""
    return {"model": SERVED_MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "system", "content": prompts[request.system]},
                         {"role": "user", "content": request.user}]}
