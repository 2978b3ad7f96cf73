"""What every results file carries, rendered the same way: the command and the machine of its
run, the versions, the method and the notes. BENCHMARKS.md names no commit and no date: a file
may record both, the report shows neither (a commit in a command is shown as REF)."""

from __future__ import annotations

import re
from typing import Any

from bench.report.fmt import num

MACHINE_KEYS = ("cpu_model", "nproc", "cpus", "usable_cpus", "platform", "debian", "kernel", "python",
                "mem_total", "mem_gib", "cpu_accounting", "loadavg", "loadavg_at_start", "pressure_cpu")
# A commit hash as git prints one: 7 to 40 hex digits with both letters and digits in it (a
# branch name, a number or a word is left alone).
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


# A date, with its time and a time range after it (", 2026-12-02 03:19-03:21").
_DATE = re.compile(r",?\s*\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})?)?"
                   r"(?:\s*[-–]\s*\d{2}:\d{2})?")


def without_commits(text: str) -> str:
    """`text` with every commit hash in it shown as REF."""
    return _COMMIT.sub("REF", text)


def without_dates(text: str) -> str:
    """`text` with every date (and its time) left out."""
    return _DATE.sub("", text)


def command(data: dict[str, Any]) -> str | None:
    """The command that made the file (older files keep it under `meta`)."""
    return data.get("command") or (data.get("meta") or {}).get("command")


def provenance(data: dict[str, Any], file_name: str) -> str:
    lines = [f"Source: `bench/results/{file_name}`"]
    given = command(data)
    if given:
        shown = without_commits(given)
        ref = "" if shown == given else " (REF: the git commit it compared against, recorded in the file)"
        lines.append(f"Command: `{shown}`{ref}")
    else:
        lines.append("Command: not recorded in the file")
    return "  \n".join(lines)


def machine(data: dict[str, Any]) -> str:
    info = data.get("machine") or (data.get("meta") or {}).get("machine") or {}
    if not info:
        return "Machine: not recorded in the file"
    parts = [f"{key} {_value(key, info[key])}" for key in MACHINE_KEYS if info.get(key) is not None]
    end = info.get("at_end") or {}
    at_end = next((v for v in (end.get("loadavg"), info.get("loadavg_end"), data.get("loadavg_at_end"))
                   if v is not None), None)
    if at_end is not None:
        parts.append(f"loadavg at end {num(at_end)}")
    if end.get("pressure_cpu"):
        parts.append(f"pressure_cpu at end {_value('pressure_cpu', end['pressure_cpu'])}")
    return "Machine: " + "; ".join(parts)


def _value(key: str, value: Any) -> str:
    if key == "pressure_cpu":
        # "some avg10=.. avg60=.. avg300=.. total=..": the share of time runnable tasks waited
        # for a CPU; the averages say enough, the "full" line is always 0 for CPU.
        lines = value.splitlines() if isinstance(value, str) else value
        if isinstance(lines, list) and lines:
            return "`" + lines[0].rsplit(" total=", 1)[0] + "`"
    return num(value)


def versions(data: dict[str, Any]) -> str:
    info = data.get("versions") or {}
    if not info:
        return ""
    return "Versions: " + ", ".join(f"{k} {num(v)}" for k, v in info.items())


def method(data: dict[str, Any]) -> str:
    info = data.get("method")
    if not info:
        return ""
    if isinstance(info, str):
        return f"Method: {info}"
    lines = ["Method:", ""]
    lines += [f"- **{k}**: {num(v) if not isinstance(v, dict) else _inline(v)}" for k, v in info.items()]
    return "\n".join(lines)


def _inline(mapping: dict[str, Any]) -> str:
    return "; ".join(f"{k} {num(v)}" for k, v in mapping.items())


def notes(data: dict[str, Any]) -> str:
    items = data.get("notes") or []
    if not items:
        return ""
    return "\n".join(["Notes from the run:", "", *[f"- {num(n)}" for n in items]])


def smoke_warning(data: dict[str, Any]) -> str:
    """A quick run checks the harness; its figures (one short repeat) are not a measurement."""
    words = str(command(data) or "").split()
    method_info = data.get("method")
    repeats = method_info.get("repeats") if isinstance(method_info, dict) else None
    if "--quick" not in words and repeats != 1:
        return ""
    return ("> **Smoke run** (`--quick` or a single repeat): it shows the harness works; its "
            "figures are too short and too few to support a conclusion. Rerun the full default "
            "on a quiet machine.")


def settled(reason: str) -> str:
    """The note of a result whose benchmark is gone: its question is answered and it guards no
    regression, so its code went and its result stays."""
    return f"> **Settled**: {reason} The benchmark's code is gone; its last result stays here."


def header_blocks(data: dict[str, Any], file_name: str) -> list[str]:
    blocks = (smoke_warning(data), provenance(data, file_name), machine(data), versions(data))
    return [b for b in blocks if b]
