"""What every results file carries, rendered the same way: the command, the machine, the
versions, the method and the notes."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import num

MACHINE_KEYS = ("cpu_model", "nproc", "usable_cpus", "kernel", "python", "mem_total", "loadavg",
                "loadavg_at_start", "loadavg_at_end", "pressure_cpu")


def provenance(data: dict[str, Any], file_name: str) -> str:
    lines = [f"Source: `bench/results/{file_name}`"]
    if data.get("command"):
        lines.append(f"Command: `{data['command']}`")
    when = " → ".join(str(data[k]) for k in ("started_at", "finished_at") if data.get(k))
    if when:
        lines.append(f"Run: {when}")
    return "  \n".join(lines)


def machine(data: dict[str, Any]) -> str:
    info = data.get("machine") or {}
    if not info:
        return ""
    parts = [f"{key} {_value(key, info[key])}" for key in MACHINE_KEYS if info.get(key) is not None]
    end = info.get("at_end") or {}
    if end.get("loadavg") is not None:
        parts.append(f"loadavg at end {num(end['loadavg'])}")
    if end.get("pressure_cpu"):
        parts.append(f"pressure_cpu at end {_value('pressure_cpu', end['pressure_cpu'])}")
    return "Machine: " + "; ".join(parts) if parts else ""


def _value(key: str, value: Any) -> str:
    if key == "pressure_cpu" and isinstance(value, list) and value:
        # "some avg10=.. avg60=.. avg300=.. total=..": the share of time runnable tasks waited
        # for a CPU; the averages say enough, the "full" line is always 0 for CPU.
        return "`" + value[0].rsplit(" total=", 1)[0] + "`"
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
    command = str(data.get("command", ""))
    method_info = data.get("method")
    repeats = method_info.get("repeats") if isinstance(method_info, dict) else None
    if "--quick" not in command.split() and repeats != 1:
        return ""
    return ("> **Smoke run** (`--quick` or a single repeat): it shows the harness works; its "
            "figures are too short and too few to support a conclusion. Rerun the full default "
            "on a quiet machine.")


def header_blocks(data: dict[str, Any], file_name: str) -> list[str]:
    blocks = (smoke_warning(data), provenance(data, file_name), machine(data), versions(data))
    return [b for b in blocks if b]
