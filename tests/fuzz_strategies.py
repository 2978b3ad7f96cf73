"""Hypothesis strategies for tests/test_fuzz.py, each paired with its oracle (what
docs/protocol.md says must happen).

Data plane: a `DataCase` is the raw bytes of one POST plus what must come back: `ok` (a body
the proxy and the simulated instance both accept: 200), `reject` (the proxy must refuse it:
given statuses and error codes, the detail naming one of `names`) or `any` (only the global
invariants apply: no 5xx, the error shape, the worker header).

Control plane: register / heartbeat / unregister operations with the fields that make them
invalid already known, so the test can keep a model of the instance table.

The bugs this fuzz found have regression tests in tests/test_fuzz.py. Two limits of the
generation remain: JSON nested deeper than DEEP_SAFE is left to those tests (it is slow to
generate), and with a live KDN Knowledge_length stays below 256, because the simulated KDN
serializes transfers per target and does not abandon one when its caller gives up, so one huge
transfer would make every later example wait for the KV-inject timeout.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BODY_LIMIT = 8 * 1024 * 1024          # PROXY_MAX_BODY_BYTES default
DEEP_SAFE = 200                       # nesting depth that stays clear of the RecursionError bug
RAW_MARK = "~~FUZZ-RAW~~"             # replaced by raw bytes after JSON encoding
# cacheroute_proxy/instance_wire.py Host: hostname labels of 1-63 letters/digits/inner hyphens, IPv4, IPv6 plain or
# bracketed (written out again here: the oracle must not import what it checks).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_RE = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f]*:[0-9A-Fa-f:.]+)")
MAX_ID_BYTES = 112                    # shm_schema/layout.py MAX_ID_BYTES (= InstanceId max_length)
PAD_SIZES = (1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024, BODY_LIMIT - 64 * 1024)

DELETE = object()


# --- building blocks -----------------------------------------------------------------------------
def texts(max_size: int = 40, min_size: int = 0) -> st.SearchStrategy[str]:
    """Any Unicode except lone surrogates (NUL, controls, RTL marks, emoji, CJK, ...)."""
    return st.text(st.characters(exclude_categories=("Cs",)), min_size=min_size, max_size=max_size)


finite = st.floats(allow_nan=False, allow_infinity=False)
json_scalars = st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | finite | texts(20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts(10), inner, max_size=4), max_leaves=12)


def nested(depth: int, leaf: Any = 1, kind: str = "list") -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"n": value}
    return value


deep_values = st.builds(nested, st.integers(1, DEEP_SAFE), json_scalars, st.sampled_from(["list", "dict"]))

wrong_for_str = (st.integers() | finite | st.booleans()
                 | st.lists(st.integers(), max_size=2) | st.dictionaries(texts(5), st.integers(), max_size=2))
wrong_for_int = (st.sampled_from(["abc", "5", "", "1e3", "0x10"]) | texts(10) | st.booleans()
                 | finite | st.lists(st.integers(), max_size=2)
                 | st.dictionaries(texts(5), st.integers(), max_size=2))
wrong_for_bool = (st.sampled_from(["maybe", "true", "false", "1", "", "yes"]) | st.integers()
                  | finite | st.lists(st.booleans(), max_size=2)
                  | st.dictionaries(texts(5), st.booleans(), max_size=2))
wrong_for_float = (st.sampled_from(["abc", "0.5", ""]) | st.booleans() | st.lists(finite, max_size=2)
                   | st.dictionaries(texts(5), st.integers(), max_size=2))
wrong_for_list = (texts(10) | st.integers() | st.booleans() | st.dictionaries(texts(5), st.integers(), max_size=2))
wrong_for_object = (st.none() | texts(10) | st.integers() | st.booleans() | st.lists(st.integers(), max_size=3))


def out_of(lo: int | None, hi: int | None) -> st.SearchStrategy[int]:
    """Integers outside [lo, hi], up to 10**100 (msgspec refuses more than 4300 digits itself)."""
    parts = []
    if lo is not None:
        parts.append(st.integers(-(10 ** 100), lo - 1))
    if hi is not None:
        parts.append(st.integers(hi + 1, 10 ** 100) | st.sampled_from([2 ** 63, 2 ** 64, 10 ** 30]))
    return st.one_of(*parts)


def out_of_float(lo: float, hi: float) -> st.SearchStrategy[float]:
    return (st.floats(max_value=lo, allow_nan=False, allow_infinity=False)
            | st.floats(min_value=hi, allow_nan=False, allow_infinity=False)).filter(lambda v: v < lo or v > hi)


def pick(draw: Any, options: Any) -> Any:
    """One of `options`, close to uniformly: sampled_from alone favours the first elements
    heavily when it is one draw among many; the sum of two draws spreads it."""
    options = list(options)
    n = len(options)
    return options[(draw(st.integers(0, n - 1)) + draw(st.integers(0, n - 1))) % n]


# --- data plane ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataCase:
    path: str
    raw: bytes
    expect: str                                  # "ok" | "reject" | "any"
    label: str
    stream: bool = False
    statuses: frozenset[int] = frozenset()
    codes: frozenset[str] = frozenset()
    names: tuple[str, ...] = ()                  # the detail names one of these

    def __repr__(self) -> str:  # bodies can be megabytes: show the head and the size
        raw = self.raw if len(self.raw) <= 600 else self.raw[:600] + b"...(%d bytes)" % len(self.raw)
        return (f"DataCase(label={self.label!r}, path={self.path!r}, expect={self.expect!r}, "
                f"statuses={sorted(self.statuses)}, names={self.names!r}, raw={raw!r})")


def encode(body: Any, ascii_only: bool) -> bytes:
    return json.dumps(body, ensure_ascii=ascii_only, allow_nan=False).encode("utf-8")


small_max_tokens = st.none() | st.integers(1, 8)


def chat_messages() -> st.SearchStrategy[list[dict[str, Any]]]:
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts(60)}), max_size=3)
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | texts(12)},
        optional={"content": st.none() | texts(200) | parts, "name": texts(12)})
    return st.lists(message, min_size=1, max_size=3)


def openai_extras() -> dict[str, st.SearchStrategy[Any]]:
    return {"model": st.none() | texts(30), "stream": st.booleans(), "max_tokens": small_max_tokens,
            "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "user": texts(20),
            "x_extra": json_values, "x_deep": deep_values}


def valid_chat() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"messages": chat_messages()}, optional=openai_extras())


def valid_completion() -> st.SearchStrategy[dict[str, Any]]:
    prompt = texts(200) | st.lists(texts(60), min_size=1, max_size=3)
    return st.fixed_dictionaries({"prompt": prompt}, optional=openai_extras())


INJECTION_TYPES = ["kvcache", "kv", "kv_cache", "kv-cache", "text", "prompt", " KV ", "TEXT"]
KNOWLEDGE_IDS = [f"k{i:04d}" for i in (0, 1, 2, 3, 7, 42, 199)] + ["K0005", "k9999", "nope"]


def valid_scheduler(kdn_addr: str) -> st.SearchStrategy[dict[str, Any]]:
    prompt = st.fixed_dictionaries(
        {"model": texts(30), "user_prompt": texts(200)},
        optional={"token_length": st.none() | st.integers(0, 100_000_000), "bs": st.integers(-(2 ** 70), 2 ** 70),
                  "max_tokens": small_max_tokens, "stream": st.booleans(),
                  "temperature": st.none() | st.floats(0, 100), "top_p": st.none() | st.floats(0, 1)})
    # Addresses that never leave the host: refused ports, URL garbage, the reserved .invalid TLD.
    unreachable = (st.sampled_from(["", "127.0.0.1:1", "0.0.0.0:9", "::::", "a b", "[::1]:1", "x.invalid/../y",
                                    "127.0.0.1:99999", "127.0.0.1:-1", "[::1", "localhost:0"])
                   | st.builds("127.0.0.1:1/{}".format, texts(20))
                   | st.builds("{}.invalid".format, st.from_regex(r"[a-z0-9-]{1,12}(:[0-9]{1,5})?", fullmatch=True)))

    def service(live_kdn: bool) -> st.SearchStrategy[dict[str, Any]]:
        # Knowledge_length >= 256 with a live KDN: the simulated KDN's limit (module docstring).
        length = st.integers(0, 255) if live_kdn else st.integers(0, 100_000_000)
        return st.fixed_dictionaries({}, optional={
            "Enable_know_injection": st.booleans(),
            "Injection_type": st.sampled_from(INJECTION_TYPES) | texts(10),
            "Knowledge_List": st.lists(st.sampled_from(KNOWLEDGE_IDS) | texts(8), max_size=4),
            "Knowledge_length": length, "Endpoint_type": st.none() | texts(20),
            "Enable_PD_Disaggregation": st.booleans(), "SLO_TTFT": st.integers(0, 10 ** 6)})

    def sections(live_kdn: bool) -> st.SearchStrategy[dict[str, Any]]:
        addr = st.just(kdn_addr) if live_kdn else unreachable
        return st.fixed_dictionaries({"Prompt": prompt}, optional={
            "Request_ID": st.integers(-(2 ** 70), 2 ** 70), "Request_type": texts(12),
            "Service": service(live_kdn),
            "Task": st.fixed_dictionaries({}, optional={"KDN_server_addr": addr, "User_addr": texts(12)}),
            "x_extra": json_values})

    return sections(True) | sections(False)


def _streams(path: str, body: dict[str, Any]) -> bool:
    if "Prompt" in body:
        return path == CHAT and bool(body["Prompt"].get("stream", False))
    return bool(body.get("stream", False))


@st.composite
def valid_request(draw: Any, kdn_addr: str) -> tuple[str, dict[str, Any]]:
    kind = pick(draw, ["chat", "completion", "scheduler", "scheduler"])
    if kind == "chat":
        return CHAT, draw(valid_chat())
    if kind == "completion":
        return COMPLETIONS, draw(valid_completion())
    return draw(st.sampled_from([CHAT, COMPLETIONS])), draw(valid_scheduler(kdn_addr))


# Mutations that the proxy's validation must refuse with 422, naming the field.
# (path, wrong-value strategy or DELETE, name in the detail)
Mutation = tuple[tuple[Any, ...], Any, str]


def _openai_mutations(path: str) -> list[Mutation]:
    common = [(("stream",), st.none() | wrong_for_bool, "stream"),
              (("max_tokens",), wrong_for_int | out_of(1, 1_000_000), "max_tokens"),
              (("model",), wrong_for_str, "model")]
    if path == CHAT:
        return common + [
            (("messages",), DELETE, "messages"), (("messages",), st.none() | wrong_for_list, "messages"),
            (("messages",), st.just([]), "messages"),
            (("messages", 0), st.none() | texts(5) | st.integers() | st.lists(st.integers(), max_size=2), "messages"),
            (("messages", 0, "role"), DELETE, "role"), (("messages", 0, "role"), st.none() | wrong_for_str, "role")]
    return common + [(("prompt",), DELETE, "prompt"),
                     (("prompt",), st.none() | st.integers() | finite | st.booleans()
                      | st.dictionaries(texts(5), st.integers(), max_size=2), "prompt")]


SCHEDULER_MUTATIONS: list[Mutation] = [
    (("Prompt",), wrong_for_object, "Prompt"),
    (("Prompt", "model"), DELETE, "model"), (("Prompt", "model"), st.none() | wrong_for_str, "model"),
    (("Prompt", "user_prompt"), DELETE, "user_prompt"),
    (("Prompt", "user_prompt"), st.none() | wrong_for_str, "user_prompt"),
    (("Prompt", "token_length"), wrong_for_int | out_of(0, 100_000_000), "token_length"),
    (("Prompt", "max_tokens"), wrong_for_int | out_of(1, 1_000_000), "max_tokens"),
    (("Prompt", "stream"), st.none() | wrong_for_bool, "stream"),
    (("Prompt", "temperature"), wrong_for_float | out_of_float(0, 100), "temperature"),
    (("Prompt", "top_p"), wrong_for_float | out_of_float(0, 1), "top_p"),
    (("Prompt", "bs"), st.none() | wrong_for_int, "bs"),
    (("Request_ID",), st.none() | wrong_for_int, "Request_ID"),
    (("Request_type",), st.none() | wrong_for_str, "Request_type"),
    (("Service",), wrong_for_object, "Service"),
    (("Service", "Enable_know_injection"), st.none() | wrong_for_bool, "Enable_know_injection"),
    (("Service", "Injection_type"), st.none() | wrong_for_str, "Injection_type"),
    (("Service", "Knowledge_List"), st.none() | wrong_for_list, "Knowledge_List"),
    (("Service", "Knowledge_List"), st.lists(st.integers() | st.none(), min_size=1, max_size=3), "Knowledge_List"),
    (("Service", "Knowledge_length"), st.none() | wrong_for_int | out_of(0, 100_000_000), "Knowledge_length"),
    (("Service", "Endpoint_type"), wrong_for_str, "Endpoint_type"),
    (("Task",), wrong_for_object, "Task"),
    (("Task", "KDN_server_addr"), st.none() | wrong_for_str, "KDN_server_addr"),
]


def set_path(body: Any, path: tuple[Any, ...], value: Any) -> None:
    node = body
    for key in path[:-1]:
        if isinstance(key, str) and key not in node:
            node[key] = {}
        node = node[key]
    if value is DELETE:
        node.pop(path[-1], None) if isinstance(node, dict) else node.pop(path[-1])
    else:
        node[path[-1]] = value


# Families of generators; each data-plane property draws from one family, so every family gets
# its own example budget (sampled_from favours its first elements heavily).
FAMILIES = {
    "valid": ("valid",),
    "invalid_fields": ("mutate", "mutate", "mutate", "wrong_endpoint"),
    "malformed": ("bad_utf8", "truncated", "random_bytes", "non_object", "lone_surrogate", "trailing_garbage"),
    "garbage_and_huge": ("huge_pad", "garbage_fields", "huge_invalid"),
}
SMALL = FAMILIES["valid"] + FAMILIES["invalid_fields"] + FAMILIES["malformed"] + ("garbage_fields",)


@st.composite
def data_case(draw: Any, kdn_addr: str, branches: tuple[str, ...] = SMALL) -> DataCase:
    ascii_only = draw(st.booleans())
    path, body = draw(valid_request(kdn_addr))
    branch = pick(draw, branches)

    if branch == "valid":
        return DataCase(path, encode(body, ascii_only), "ok", "valid", stream=_streams(path, body))

    if branch == "mutate":
        table = SCHEDULER_MUTATIONS if "Prompt" in body else _openai_mutations(path)
        where, wrong, name = pick(draw, table)
        set_path(body, where, DELETE if wrong is DELETE else draw(wrong))
        return DataCase(path, encode(body, ascii_only), "reject", f"mutate {'.'.join(map(str, where))}",
                        statuses=frozenset({422}), codes=frozenset({"invalid_request_payload"}),
                        names=(name,))

    if branch == "wrong_endpoint" and "Prompt" not in body:
        other, missing = (COMPLETIONS, "prompt") if path == CHAT else (CHAT, "messages")
        return DataCase(other, encode(body, ascii_only), "reject", "wrong endpoint",
                        statuses=frozenset({422}), codes=frozenset({"invalid_request_payload"}), names=(missing,))

    if branch == "non_object":
        value = draw(st.lists(json_values, max_size=4) | json_scalars
                     | st.builds(nested, st.integers(1, DEEP_SAFE)))
        return DataCase(path, encode(value, ascii_only), "reject", "non-object JSON",
                        statuses=frozenset({400}), codes=frozenset({"invalid_request_payload"}), names=("object",))

    if branch == "random_bytes":
        raw = draw(st.binary(max_size=300))
        return DataCase(path, raw, "reject", "random bytes", statuses=frozenset({400, 422}),
                        codes=frozenset({"invalid_json", "invalid_request_payload"}))

    if branch == "truncated":
        raw = encode(body, ascii_only)
        cut = draw(st.integers(0, len(raw) - 1))
        return DataCase(path, raw[:cut], "reject", "truncated JSON", statuses=frozenset({400}),
                        codes=frozenset({"invalid_json"}), names=("JSON",))

    if branch in ("bad_utf8", "lone_surrogate"):
        body["x_raw"] = f"a{RAW_MARK}b"
        if branch == "bad_utf8":
            bad = draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                                        b"\xc0\xaf", b"\x80", b"\xe2\x82", b"\x00", b"\n", b"\x1f"])
                       | st.binary(min_size=1, max_size=8).filter(_not_utf8))
            return DataCase(path, encode(body, ascii_only).replace(RAW_MARK.encode(), bad), "reject",
                            "invalid UTF-8 / raw control byte in a string", statuses=frozenset({400}),
                            codes=frozenset({"invalid_json"}), names=("JSON",))
        escape = draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\udc00\\ud800", b"\\ud83d"]))
        return DataCase(path, encode(body, ascii_only).replace(RAW_MARK.encode(), escape), "any",
                        "lone surrogate escape")

    if branch == "trailing_garbage":
        tail = draw(st.sampled_from([b"x", b"{}", b",", b"]", b"\x00"]) | st.binary(min_size=1, max_size=10)
                    .filter(lambda b: b.strip(b" \t\r\n") != b""))
        return DataCase(path, encode(body, ascii_only) + tail, "reject", "trailing garbage",
                        statuses=frozenset({400}), codes=frozenset({"invalid_json"}), names=("JSON",))

    if branch == "garbage_fields":
        # Nested garbage anywhere at the top level: the proxy may accept (the instance then
        # answers, 200 or its own 400) or refuse it; only the global invariants apply.
        for _ in range(draw(st.integers(1, 3))):
            # (not max_tokens: an in-range value would make the instance generate 8192 tokens)
            body[draw(st.sampled_from(["messages", "prompt", "Prompt", "Service", "Task", "stream",
                                       "model", "Request_ID", "temperature"]) | texts(8))] = draw(
                json_values | deep_values)
        return DataCase(path, encode(body, ascii_only), "any", "garbage fields")

    if branch == "huge_pad":
        # A valid body carrying megabytes in a key the instance ignores: forwarded byte for byte.
        size = draw(st.sampled_from(PAD_SIZES))
        unit = draw(st.sampled_from(["a", "é", "€", "😀", "\\"]))
        body["x_pad"] = unit * (size // (len(encode(unit, ascii_only)) - 2))
        raw = encode(body, ascii_only)
        assert len(raw) <= BODY_LIMIT, len(raw)
        return DataCase(path, raw, "ok", f"huge pad {size} x {unit!r}", stream=_streams(path, body))

    if branch == "huge_invalid":
        size = draw(st.sampled_from(PAD_SIZES[:4]))
        target = ("Prompt", "max_tokens") if "Prompt" in body else ("max_tokens",)
        set_path(body, target, "9" * size)
        return DataCase(path, encode(body, ascii_only), "reject", f"huge string in max_tokens ({size})",
                        statuses=frozenset({422}), codes=frozenset({"invalid_request_payload"}),
                        names=("max_tokens",))

    return DataCase(path, encode(body, ascii_only), "ok", "valid (fallback)", stream=_streams(path, body))


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# --- control plane -------------------------------------------------------------------------------
def host_is_valid(host: Any) -> bool:
    return isinstance(host, str) and 1 <= len(host) <= 64 and HOST_RE.fullmatch(host) is not None


def host_known_bug(host: Any) -> bool:
    """Hosts the fuzz leaves to the regression tests: none since their fixes."""
    return False


def host_routable(host: str) -> bool:
    """Would aiohttp get as far as resolving `http://{host}:port/`? (idna can encode it)."""
    if ":" in host or "[" in host or "]" in host:
        return True   # an invalid URL here is an aiohttp ClientError: a 502, not a 500
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def host_stays_local(host: str) -> bool:
    """Would traffic to this host stay on this machine (or fail before leaving it)? Used where
    the data plane really connects: no public address, no name a resolver might know."""
    if host.startswith("[") and host.endswith("]"):
        try:
            address = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return True          # not a valid bracketed address: aiohttp refuses the URL
        return address.is_loopback or address.is_unspecified
    if ":" in host or "[" in host or "]" in host:
        return True              # unbracketed colon: aiohttp refuses the URL
    try:
        packed = socket.inet_aton(host)   # what getaddrinfo accepts as a numeric IPv4 ("0x7f.1")
    except OSError:
        name = host.lower().rstrip(".")
        return name == "localhost" or name.endswith(".invalid")
    return packed[0] in (0, 127)


# Hosts the control plane accepts, for the cross-plane property: every one must be routable
# (a 502 at worst) and must keep traffic on this machine.
routable_hosts = st.one_of(
    st.sampled_from(["127.0.0.1", "localhost", "localhost.", "[::1]", "::1", "0", "127.1", "0x7f.1", "0177.0.0.1",
                     "[", "]", ":", "a:b", "[::1]:80", "[::]", "[::1", "127.0.0.1:80", "-.invalid", "_x.invalid"]),
    st.builds("{}.invalid".format, st.from_regex(r"[A-Za-z0-9_-]{1,20}(\.[A-Za-z0-9_-]{1,20}){0,2}", fullmatch=True)),
    st.from_regex(r"[0-9a-fA-Fx:\[\].]{1,30}", fullmatch=True),
).filter(lambda h: host_is_valid(h) and not host_known_bug(h) and host_stays_local(h))


def id_is_valid(instance_id: Any) -> bool:
    return (isinstance(instance_id, str) and 1 <= len(instance_id) <= MAX_ID_BYTES
            and len(instance_id.encode("utf-8")) <= MAX_ID_BYTES)


hosts_any = st.one_of(
    st.sampled_from(["127.0.0.1", "localhost", "[::1]", "::1", "10.0.0.7", "my-host.example", "a", "-", "0",
                     "host.", "A-b_c:d", "[fe80::1%25eth0]", "h" * 63 + ".x"]),
    st.from_regex(r"[A-Za-z0-9._:\[\]-]{1,70}", fullmatch=True),
    texts(70),
    st.sampled_from(["", " ", "http://x", "x/y", "a b", "127.0.0.1 ", "\t", "ä.example", "h" * 65, "x\ny"]),
).filter(lambda h: not host_known_bug(h))

bad_id_chars = st.one_of(st.just(""), st.text(st.characters(exclude_categories=("Cs",)), min_size=113, max_size=140))
bad_id_bytes = st.text(st.characters(min_codepoint=0x800, exclude_categories=("Cs",)), min_size=38, max_size=112)


def valid_ids(fixture_id: str) -> st.SearchStrategy[str]:
    """Ids the control plane must accept: 1..112 characters and at most 112 bytes of UTF-8."""
    return st.one_of(
        texts(40, min_size=1),
        st.text(st.sampled_from("ab-_.:"), min_size=1, max_size=112),
        st.sampled_from(["x" * 112, "é" * 56, "😀" * 28, "\x00", "id with spaces", "\u202eRTL", "a/b?c#d"]),
    ).filter(lambda i: id_is_valid(i) and i != fixture_id)


capability_sections = {
    "schema_version": texts(5),
    "model": st.fixed_dictionaries({}, optional={"identifier": st.none() | texts(20), "revision": st.none() | texts(8)}),
    "tokenizer": st.none() | st.dictionaries(texts(8), json_scalars, max_size=3),
    "adapters": st.none() | st.lists(json_values, max_size=3),
    "kv_cache": st.fixed_dictionaries({}, optional={
        "layout": texts(8), "schema_version": texts(4), "dtype": st.sampled_from(["fp16", "bf16"]),
        "block_size": st.integers(-(2 ** 40), 2 ** 40), "layout_parameters": st.dictionaries(texts(5), json_scalars, max_size=3)}),
    "parallelism": st.fixed_dictionaries({}, optional={
        "tensor_parallel_size": st.integers(0, 64), "pipeline_parallel_size": st.integers(0, 64),
        "data_parallel_size": st.none() | st.integers(0, 64)}),
    "runtime": st.fixed_dictionaries({}, optional={
        "vllm_version": texts(8), "lmcache_version": st.none() | texts(8),
        "supported_cache_features": st.lists(st.sampled_from(["a", "b", "prefix"]) | texts(6), max_size=4)}),
}
valid_capabilities = st.fixed_dictionaries({}, optional=capability_sections)


@st.composite
def invalid_capabilities(draw: Any) -> Any:
    caps = draw(valid_capabilities)
    how = draw(st.sampled_from(["unknown_top", "unknown_nested", "wrong_section", "not_object"]))
    if how == "not_object":
        return draw(texts(5) | st.integers() | st.lists(st.integers(), max_size=2))
    if how == "unknown_top":
        caps[draw(texts(10).filter(lambda k: k not in capability_sections))] = draw(json_scalars)
    elif how == "unknown_nested":
        section = draw(st.sampled_from(["model", "kv_cache", "parallelism", "runtime"]))
        caps.setdefault(section, {})["x_" + draw(texts(6))] = draw(json_scalars)
    else:
        caps[draw(st.sampled_from(["model", "kv_cache", "parallelism", "runtime"]))] = draw(
            texts(5) | st.integers() | st.lists(st.integers(), max_size=2))
    return caps


@dataclass
class Op:
    """One control-plane call. `invalid` names the fields that make it a 4xx (empty: valid).
    `ref` (heartbeat/unregister) is an index into the ids registered so far, or None to use
    `payload["instance_id"]` as is."""

    kind: str                                   # register | heartbeat | unregister | garbage
    payload: Any
    invalid: frozenset[str] = frozenset()
    ref: int | None = None
    raw: bytes | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        shown = self.raw if self.raw is not None else self.payload
        text = repr(shown)
        return f"Op({self.kind}, invalid={sorted(self.invalid)}, ref={self.ref}, {text[:400]})"


@st.composite
def register_op(draw: Any, fixture_id: str) -> Op:
    payload: dict[str, Any] = {}
    invalid: set[str] = set()
    bad = pick(draw, [None] * 8 + ["host", "host", "port", "instance_id", "instance_id", "weight", "endpoints",
                                   "tags", "meta", "capabilities", "capability_fingerprint", "missing_host",
                                   "missing_port"])
    # host
    if bad == "missing_host":
        invalid.add("host")
    else:
        host = (draw(hosts_any | wrong_for_str | st.none()) if bad == "host"
                else draw(st.sampled_from(["127.0.0.1", "localhost", "[::1]", "10.0.0.7", "node-3.cluster.local"])
                          | st.from_regex(r"[A-Za-z0-9.-]{1,40}", fullmatch=True).filter(host_routable)))
        payload["host"] = host
        if not host_is_valid(host):
            invalid.add("host")
    # port
    if bad == "missing_port":
        invalid.add("port")
    else:
        port = (draw(out_of(1, 65535) | wrong_for_int | st.none()) if bad == "port" else draw(st.integers(1, 65535)))
        payload["port"] = port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            invalid.add("port")
    # instance_id: omitted (hp_host:port), null, or given
    choice = draw(st.sampled_from(["omit", "null", "given", "given"])) if bad != "instance_id" else "bad"
    if choice == "null":
        payload["instance_id"] = None
    elif choice == "given":
        payload["instance_id"] = draw(valid_ids(fixture_id))
    elif choice == "bad":
        value = draw(bad_id_chars | bad_id_bytes | st.sampled_from(["x" * 113, "é" * 57, "😀" * 29])
                     | wrong_for_str)
        payload["instance_id"] = value
        invalid.add("instance_id")
    # optional fields
    if bad == "weight":
        payload["weight"] = draw(st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)
                                 | st.integers(max_value=-1) | st.none() | st.booleans() | texts(4))
        invalid.add("weight")
    elif draw(st.booleans()):
        payload["weight"] = draw(st.floats(0, 1e300) | st.integers(0, 10 ** 6))
    for name in ("endpoints", "tags"):
        if bad == name:
            payload[name] = draw(wrong_for_list | st.none() | st.lists(st.integers(), min_size=1, max_size=2))
            invalid.add(name)
        elif draw(st.booleans()):
            payload[name] = draw(st.lists(texts(20), max_size=3))
    if bad == "meta":
        payload["meta"] = draw(st.none() | texts(5) | st.integers() | st.lists(st.integers(), max_size=2))
        invalid.add("meta")
    elif draw(st.booleans()):
        meta = draw(st.dictionaries(texts(10), json_values, max_size=3))
        if draw(st.booleans()):
            meta["cp_port"] = draw(st.integers(-5, 70000) | texts(5) | st.none() | st.booleans())
        if draw(st.booleans()):
            meta["deep"] = draw(deep_values)
        payload["meta"] = meta
    if bad == "capabilities":
        payload["capabilities"] = draw(invalid_capabilities())
        invalid.add("capabilities")
    elif draw(st.booleans()):
        payload["capabilities"] = draw(st.none() | valid_capabilities)
    if bad == "capability_fingerprint":
        payload["capability_fingerprint"] = draw(st.integers() | st.booleans() | st.lists(st.integers(), max_size=2))
        invalid.add("capability_fingerprint")
    elif draw(st.booleans()):
        payload["capability_fingerprint"] = draw(st.none() | texts(20))
    if draw(st.booleans()):
        payload[draw(st.sampled_from(["x_unknown", "Host", "PORT"]) | texts(8)
                     .filter(lambda k: k not in RegisterFields))] = draw(json_values)
    return Op("register", payload, frozenset(invalid))


RegisterFields = {"host", "port", "instance_id", "endpoints", "tags", "weight", "meta", "capabilities",
                  "capability_fingerprint"}


@st.composite
def heartbeat_op(draw: Any, fixture_id: str) -> Op:
    payload: dict[str, Any] = {}
    invalid: set[str] = set()
    ref = None
    how = draw(st.sampled_from(["known", "known", "unknown", "bad_id", "missing_id", "bad_field"]))
    if how == "known":
        ref = draw(st.integers(0, 20))
    elif how == "unknown":
        payload["instance_id"] = draw(valid_ids(fixture_id))
    elif how == "bad_id":
        payload["instance_id"] = draw(bad_id_chars | wrong_for_str | st.none())
        invalid.add("instance_id")
    elif how == "missing_id":
        invalid.add("instance_id")
    if how == "bad_field":
        ref = draw(st.integers(0, 20))
        name = draw(st.sampled_from(["qps_1m", "gpu_util", "inflight", "capabilities", "capability_fingerprint"]))
        payload[name] = draw({"qps_1m": st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)
                              | texts(3) | st.booleans(),
                              "gpu_util": st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False) | texts(3),
                              "inflight": wrong_for_int,
                              "capabilities": invalid_capabilities(),
                              "capability_fingerprint": st.integers() | st.booleans()}[name])
        invalid.add(name)
    else:
        for name, value in (("qps_1m", st.none() | st.floats(0, 1e300)), ("gpu_util", st.none() | st.floats(0, 100)),
                            ("inflight", st.none() | st.integers(-(2 ** 70), 2 ** 70)),
                            ("capabilities", st.none() | valid_capabilities),
                            ("capability_fingerprint", st.none() | texts(20) | st.just("sha256:0"))):
            if draw(st.booleans()):
                payload[name] = draw(value)
    return Op("heartbeat", payload, frozenset(invalid), ref=ref)


@st.composite
def unregister_op(draw: Any, fixture_id: str) -> Op:
    how = draw(st.sampled_from(["known", "known", "known", "unknown", "bad"]))
    if how == "known":
        return Op("unregister", {}, ref=draw(st.integers(0, 20)))
    if how == "unknown":
        return Op("unregister", {"instance_id": draw(valid_ids(fixture_id))})
    payload = draw(st.just({}) | st.fixed_dictionaries({"instance_id": bad_id_chars | wrong_for_str | st.none()}))
    return Op("unregister", payload, frozenset({"instance_id"}))


@st.composite
def garbage_op(draw: Any) -> Op:
    endpoint = draw(st.sampled_from(["register", "heartbeat", "unregister"]))
    raw = draw(st.binary(max_size=200)
               | st.builds(lambda v: json.dumps(v).encode(), st.lists(json_values, max_size=3) | json_scalars)
               | st.builds(lambda d: json.dumps(nested(d)).encode(), st.integers(1, DEEP_SAFE)))
    return Op("garbage", None, frozenset({"*"}), raw=raw, notes={"endpoint": endpoint})


def fill_ops(fixture_id: str) -> st.SearchStrategy[list[Op]]:
    """Several valid registrations in a row (distinct ids), enough to fill the table at times."""
    one = st.fixed_dictionaries({
        "host": st.sampled_from(["127.0.0.1", "localhost", "[::1]"]), "port": st.integers(1, 65535),
        "instance_id": valid_ids(fixture_id)})
    return st.lists(one, min_size=2, max_size=9, unique_by=lambda p: p["instance_id"]).map(
        lambda payloads: [Op("register", p) for p in payloads])


def control_ops(fixture_id: str) -> st.SearchStrategy[list[Op]]:
    op = st.one_of(register_op(fixture_id), heartbeat_op(fixture_id), unregister_op(fixture_id), garbage_op())
    steps = st.lists(op.map(lambda o: [o]) | fill_ops(fixture_id), min_size=1, max_size=10)
    return steps.map(lambda groups: [o for group in groups for o in group])


# Helpers the tests share ---------------------------------------------------------------------------
def resolved_id(payload: dict[str, Any]) -> str:
    return payload.get("instance_id") or f"hp_{payload['host']}:{payload['port']}"

