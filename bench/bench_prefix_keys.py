"""CPU a worker spends naming a plain chat request's prompt blocks as the engine does
(PROXY_AFFINITY_TOKENIZER, cacheroute_proxy/engine_prefix.py): render with the chat template,
tokenize, hash the blocks (`python -m bench.bench_prefix_keys`).

Run:  python -m bench.bench_prefix_keys --out bench/results/prefix_keys.json

In one process, with the tiny model's tokenizer and chat template (`--model-dir`, by default
.cache/tiny-llama; where that is missing, the same tokenizer.json is built in a temporary
directory by tests/real_engine/build_tiny_model.py in ~0.3 s). The workload: chats of a system
prompt of ~896 tokens, drawn from a pool of 16, and a unique user turn of ~64 tokens. For each
block size (`--block-tokens`, PROXY_AFFINITY_BLOCK_TOKENS; PROXY_AFFINITY_MAX_BLOCKS 32), the
cases, each on its own EnginePrefix:

- `whole`: the memo off (memo_entries=0): the whole prompt tokenized and hashed on every
  request, what every request cost before the memo;
- `memo`: the worker's memo, warmed with every system prompt of the pool (the steady state);
- `memo_miss`: the memo, every request with a system prompt it has never seen (a miss: the
  whole prompt tokenized, its leading part memoized);
- `multiturn_whole` / `multiturn_memo`: 16 conversations on the pool's system prompts, each
  request the next user turn of one of them after the previous answer (~32 tokens), so its
  leading messages are new but all but the last turn are those of its previous request;
  started again after 6 turns.

Each block is `--requests` requests, timed with the thread's CPU clock (time.thread_time_ns);
cases are interleaved block by block, `--repeats` blocks each, and the figure is the median.
The split into render / tokenize / hash comes from separate blocks (interleaved likewise) in
which the template's render, the tokenizer calls and the block hashing are each timed with the
same clock; `other` is the rest (rendering the messages' texts, the memo's lookups, the checks,
keys from digests). Before timing, every case's keys are checked equal to `whole`'s for the
same chats.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.harness.results import Run, tool_versions, write_report
from bench.harness.stats import median, ratio
from cacheroute_proxy import engine_prefix
from cacheroute_proxy.engine_prefix import EnginePrefix
from cacheroute_sim.processes import ROOT
from proxy_workers.request_model import Message
from tests.real_engine.build_tiny_model import WORDS, write_tokenizer_files

SYSTEM_TOKENS = 896
USER_TOKENS = 64
ANSWER_TOKENS = 32
POOL = 16
TURNS = 6
MAX_BLOCKS = 32  # PROXY_AFFINITY_MAX_BLOCKS' default
# Words the tiny tokenizer does not hold whole, so that tokenizing merges as real text needs.
EXTRA_WORDS = tuple("please always answer briefly politely using context documents retrieved "
                    "customer support assistant policy refund shipping account password "
                    "invoice order delivery warranty product manual chapter section".split())
PARTS = ("render", "tokenize", "hash")


class Workload:
    """Chats over the tiny tokenizer: texts of a given number of its tokens."""

    def __init__(self, prefix: EnginePrefix, seed: int) -> None:
        self._prefix = prefix
        self.seed = seed
        self.systems = [self.text(SYSTEM_TOKENS, random.Random(seed + i)) for i in range(POOL)]

    def text(self, tokens: int, rng: random.Random) -> str:
        """Random words that tokenize into `tokens` tokens (or one or two fewer)."""
        words = [rng.choice((*WORDS, *EXTRA_WORDS)) for _ in range(tokens)]
        low, high = 1, len(words)
        while low < high:  # the most words that stay within `tokens`
            middle = (low + high + 1) // 2
            if len(self._prefix.completion_tokens(" ".join(words[:middle]))) <= tokens:
                low = middle
            else:
                high = middle - 1
        return " ".join(words[:low])


Case = Callable[[int], list[list[Message]]]  # a block's chats, given the number of requests


def steady(work: Workload, fresh_systems: bool = False) -> Case:
    """A system prompt of the pool (or, fresh_systems, one never seen) and a unique user turn."""
    rng, serial = random.Random(work.seed), iter(range(10**9))

    def chats(n: int) -> list[list[Message]]:
        made = []
        for _ in range(n):
            system = rng.choice(work.systems)
            if fresh_systems:
                system = f"[{next(serial)}] {system}"
            made.append([Message("system", system),
                         Message("user", f"({next(serial)}) " + work.text(USER_TOKENS - 4, rng))])
        return made
    return chats


def multiturn(work: Workload) -> Case:
    """The next user turn of one of POOL conversations, after the answer to the previous one."""
    rng, serial = random.Random(work.seed), iter(range(10**9))
    conversations = [[Message("system", system)] for system in work.systems]

    def chats(n: int) -> list[list[Message]]:
        made = []
        for _ in range(n):
            index = rng.randrange(len(conversations))
            if len(conversations[index]) >= 1 + 2 * TURNS:
                conversations[index] = conversations[index][:1]
            chat = conversations[index]
            chat.append(Message("user", f"({next(serial)}) " + work.text(USER_TOKENS - 4, rng)))
            made.append(list(chat))
            chat.append(Message("assistant", work.text(ANSWER_TOKENS, rng)))
        return made
    return chats


def cases(work: Workload) -> dict[str, Case]:
    """Each case its own chats; whole and memo (and both multiturn cases) the same sequence."""
    return {"whole": steady(work), "memo": steady(work), "memo_miss": steady(work, fresh_systems=True),
            "multiturn_whole": multiturn(work), "multiturn_memo": multiturn(work)}


class Timed:
    """Thread CPU ns spent in the parts of EnginePrefix.chat_keys, while instrumented."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(PARTS, 0)

    def wrap(self, part: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time_ns()
            try:
                return call(*args, **kwargs)
            finally:
                self.ns[part] += time.thread_time_ns() - started
        return timed


class _TimedTemplate:
    def __init__(self, template: Any, timed: Timed) -> None:
        self.render = timed.wrap("render", template.render)


@contextlib.contextmanager
def instrumented(prefix: EnginePrefix, timed: Timed) -> Iterator[None]:
    saved = prefix._template, prefix._encode, prefix._encode_spans, engine_prefix.chain_digests
    prefix._template = _TimedTemplate(saved[0], timed)
    prefix._encode = timed.wrap("tokenize", saved[1])
    prefix._encode_spans = timed.wrap("tokenize", saved[2])
    engine_prefix.chain_digests = timed.wrap("hash", saved[3])
    try:
        yield
    finally:
        prefix._template, prefix._encode, prefix._encode_spans, engine_prefix.chain_digests = saved


def run_block(prefix: EnginePrefix, chats: list[list[Message]]) -> int:
    started = time.thread_time_ns()
    for chat in chats:
        prefix.chat_keys(chat)
    return time.thread_time_ns() - started


def measure(model_dir: Path, block_tokens: int, requests: int, repeats: int) -> dict[str, Any]:
    def make(memo_entries: int) -> EnginePrefix:
        return engine_prefix.load(str(model_dir), block_tokens, MAX_BLOCKS, memo_entries=memo_entries)

    def make_for(case: str) -> EnginePrefix:
        return make(0 if case.endswith("whole") else engine_prefix.LEAD_MEMO_ENTRIES)

    reference = make(0)
    work = Workload(reference, seed=block_tokens)
    for name, maker in cases(work).items():  # every case gives the whole prompt's keys
        check = make_for(name)
        for chat in maker(requests):
            assert check.chat_keys(chat) == reference.chat_keys(chat), (name, chat)
    makers = cases(work)
    prefixes = {name: make_for(name) for name in makers}
    for system in work.systems:  # the steady state: every system prompt seen once
        prefixes["memo"].chat_keys([Message("system", system), Message("user", "warm up")])
    totals: dict[str, list[float]] = {name: [] for name in makers}
    parts: dict[str, dict[str, list[float]]] = {name: {p: [] for p in (*PARTS, "other")} for name in makers}
    for _ in range(repeats):
        for name, maker in makers.items():
            totals[name].append(run_block(prefixes[name], maker(requests)) / requests / 1000)
            timed, chats = Timed(), maker(requests)
            with instrumented(prefixes[name], timed):
                spent = run_block(prefixes[name], chats)
            for part in PARTS:
                parts[name][part].append(timed.ns[part] / requests / 1000)
            parts[name]["other"].append((spent - sum(timed.ns.values())) / requests / 1000)
    tokens = sorted(len(reference.chat_tokens(chat) or []) for chat in steady(work)(51))
    return {"prompt_tokens_median": tokens[len(tokens) // 2], **summary(totals, parts, prefixes)}


def summary(totals: dict[str, list[float]], parts: dict[str, dict[str, list[float]]],
            prefixes: dict[str, EnginePrefix]) -> dict[str, Any]:
    """Medians per case, the memo's counts, and the ratios of the cases' medians."""
    middle = {name: median(values, None) for name, values in totals.items()}
    return {
        "cases": {name: {
            "cpu_us_per_request": {"median": round(middle[name], 1), "min": round(min(values), 1),
                                   "max": round(max(values), 1)},
            "parts_us_median": {p: median(v, 1) for p, v in parts[name].items()},
            "memo": prefixes[name].memo_stats()._asdict()} for name, values in totals.items()},
        "whole_over_memo": ratio(middle["whole"], middle["memo"], 1),
        "multiturn_whole_over_memo": ratio(middle["multiturn_whole"], middle["multiturn_memo"], 1),
        "miss_over_whole": ratio(middle["memo_miss"], middle["whole"], 2),
    }


def model_directory(given: Path | None, scratch: Path) -> tuple[Path, str]:
    """The model directory and where it came from."""
    default = ROOT / ".cache" / "tiny-llama"
    if given is not None:
        return given, str(given)
    if (default / "tokenizer.json").is_file():
        return default, ".cache/tiny-llama"
    return (write_tokenizer_files(scratch / "tiny-llama"),
            "tests/real_engine/build_tiny_model.py write_tokenizer_files")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a model directory (default: .cache/tiny-llama, else its tokenizer built here)")
    parser.add_argument("--block-tokens", default="16,128", help="block sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=200, help="requests per timed block")
    parser.add_argument("--repeats", type=int, default=11, help="blocks per case")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    provenance = Run("bench.bench_prefix_keys", argv)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-keys-") as scratch:
        model_dir, source = model_directory(args.model_dir, Path(scratch))
        tokenizer_sha256 = hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()
        results = {size: measure(model_dir, int(size), args.requests, args.repeats)
                   for size in args.block_tokens.split(",")}
    print(f"# µs of CPU per request, median of {args.repeats} blocks of {args.requests} "
          f"(render / tokenize / hash / other from the instrumented blocks)")
    for size, result in results.items():
        print(f"block {size} tokens, prompts of ~{result['prompt_tokens_median']} tokens:")
        for name, case in result["cases"].items():
            split = " / ".join(f"{v}" for v in case["parts_us_median"].values())
            print(f"  {name:<17}{case['cpu_us_per_request']['median']:9.1f}   ({split})")
        print(f"  whole / memo {result['whole_over_memo']}×, "
              f"multiturn {result['multiturn_whole_over_memo']}×, "
              f"a miss {result['miss_over_whole']}× whole")
    if args.out:
        write_report(args.out, {
            **provenance.record(),
            "versions": tool_versions(("tokenizers", "jinja2")),
            "model_dir": source, "tokenizer_sha256": tokenizer_sha256,
            "workload": {"system_prompt_tokens": SYSTEM_TOKENS, "system_prompts": POOL,
                         "user_turn_tokens": USER_TOKENS, "answer_tokens": ANSWER_TOKENS,
                         "turns": TURNS, "max_blocks": MAX_BLOCKS},
            "requests_per_block": args.requests, "repeats": args.repeats, "results": results,
            "method": ("µs of the thread's CPU (time.thread_time_ns) per request of "
                       "EnginePrefix.chat_keys over a block of requests, median of the blocks, cases "
                       "interleaved; the parts from separate instrumented blocks (the template's "
                       "render, the tokenizer calls, the block hashing, each timed with the same clock; "
                       "other = the rest)")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
