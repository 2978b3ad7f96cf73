"""Every setting as a row (variable, type, default, bounds, help), read from the definitions in
cacheroute_proxy/config.py: printed by `cacheroute-proxy config`, and written as the tables of
docs/configuration.md between `<!-- settings: <topic> -->` and `<!-- end of settings -->`
(`make config-doc`; tests/test_config.py fails when they are not current)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Mapping

import msgspec

from .config import FIELDS, RETIRED
from .setting import Env, Field, Topic, bounds_text, type_name

BLOCK = re.compile(r"(<!-- settings: (?P<topic>[\w-]+)[^\n]*-->\n)(?P<table>.*?)(<!-- end of settings -->)",
                   re.S)
_HEADER = "| variable | type | default | bounds | meaning |\n|---|---|---|---|---|\n"
UNSET = "unset"  # the default of a setting that is None or ""


class Row(msgspec.Struct, frozen=True):
    variable: str
    type: str
    default: str
    bounds: str
    help: str
    topic: str


def rows(word: str = "") -> list[Row]:
    """One row a setting, in the order of config.py; `word`: only variables containing it."""
    return [_row(f) for f in FIELDS if word.lower() in f.env.var.lower()]


def topics() -> list[Topic]:
    return list(dict.fromkeys(f.env.topic for f in FIELDS))


def _row(field: Field) -> Row:
    env = field.env
    return Row(env.var, type_name(field.type), _default_text(field.default), _rule_text(env), env.help,
               env.topic.key)


def _default_text(value: object) -> str:
    if value is None or value == "":
        return UNSET
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return msgspec.json.encode(value).decode() if isinstance(value, dict) else str(value)


def _rule_text(env: Env) -> str:
    """Bounds ("1..256", "> 0"), the choices (aliases in brackets), or the rule's words."""
    if env.choices:
        return ", ".join(_choice_text(name, env.choices) for name in dict.fromkeys(_canonical(env.choices)))
    words = [bounds_text(env), env.rule.text if env.rule else ""]
    if env.finite:
        words.insert(0, "finite,")
    return " ".join(filter(None, words))


def _canonical(choices: tuple[str, ...] | Mapping[str, str]) -> Iterable[str]:
    return choices.values() if isinstance(choices, Mapping) else choices


def _choice_text(name: str, choices: tuple[str, ...] | Mapping[str, str]) -> str:
    if not isinstance(choices, Mapping):
        return name
    aliases = [alias for alias, canonical in choices.items() if canonical == name and alias != name]
    return f"{name} ({', '.join(aliases)})" if aliases else name


# --- for a terminal --------------------------------------------------------------------------------
def text_listing(listed: list[Row], width: int = 100) -> str:
    """By topic: a line of variable, type, default and bounds, then the help, indented."""
    if not listed:
        return ""
    widths = [max(len(getattr(r, column)) for r in listed) for column in ("variable", "type", "default")]
    blocks = []
    for topic in topics():
        block = [topic.title]
        for r in (r for r in listed if r.topic == topic.key):
            cells = [cell.ljust(width) for cell, width in zip((r.variable, r.type, r.default), widths)]
            block.append("  ".join(["", *cells, r.bounds]).rstrip())
            block += _indented(r.help, width)
        if len(block) > 1:
            blocks.append("\n".join(block))
    return "\n\n".join(blocks) + "\n"


def retired_listing(width: int = 100) -> str:
    lines = ["Retired: no longer read, refused at start"]
    for var, why in RETIRED.items():
        lines += [f"  {var}", *_indented(why, width)]
    return "\n".join(lines) + "\n"


def _indented(markdown: str, width: int) -> list[str]:
    return textwrap.wrap(_plain(markdown), width, initial_indent=" " * 6, subsequent_indent=" " * 6)


def _plain(markdown: str) -> str:
    """The help without Markdown: links as their text, no backticks, bold or italics."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown).replace("`", "").replace("**", "")
    return re.sub(r"\*(\w+)\*", r"\1", text)


# --- for docs/configuration.md ------------------------------------------------------------------------
def markdown_table(topic_key: str, word: str = "") -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    body = "".join(
        f"| `{r.variable}` | {r.type} | {r.default if r.default == UNSET else f'`{r.default}`'} | "
        f"{cell(r.bounds)} | {cell(r.help)} |\n"
        for r in rows(word) if r.topic == topic_key)
    return _HEADER + body


def rewrite_doc(text: str) -> str:
    """`text` with each settings block holding its topic's current table; ValueError if a topic
    has no block, or a block names no topic."""
    known = {t.key for t in topics()}
    found = [m.group("topic") for m in BLOCK.finditer(text)]
    missing = sorted(known - set(found))
    unknown = sorted(set(found) - known)
    twice = sorted({key for key in found if found.count(key) > 1})
    if missing or unknown or twice:
        raise ValueError(f"settings blocks: without one {missing}, of no topic {unknown}, twice {twice}")
    return BLOCK.sub(lambda m: m.group(1) + markdown_table(m.group("topic")) + m.group(4), text)
