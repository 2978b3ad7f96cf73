"""The outline of the repository, checked from the code's own imports (read as text, nothing is
run): which top-level package may import which, that layering goes one way, that the product
never reaches for its test and demo doubles or its offline tools, that it generates no code,
that a package's private modules stay its own, that a role's package holds only what runs in
that role, and that no bit of a shared-memory format is spelled outside shm_schema."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PRODUCT = ("shm_schema", "cacheroute_proxy", "sidecar", "proxy_workers", "instance_agent")
DOUBLES = "cacheroute_sim"
# Offline tools: run by hand from the checkout (a predictor profile's calibration), never by a role.
TOOLS = "tools"
TOP_LEVEL = {*PRODUCT, DOUBLES, TOOLS, "bench", "tests"}

# Which top-level package may import which (itself always). Layering goes one way: the
# shared-memory contract at the bottom, the product package on it, the two roles on both;
# the offline tools, the doubles and the benchmarks above the product; nothing of the product
# above them.
ALLOWED: dict[str, set[str]] = {
    "shm_schema": set(),
    "cacheroute_proxy": {"shm_schema"},
    "sidecar": {"shm_schema", "cacheroute_proxy"},
    "proxy_workers": {"shm_schema", "cacheroute_proxy"},
    "instance_agent": {"cacheroute_proxy"},
    TOOLS: {"shm_schema", "cacheroute_proxy", "proxy_workers"},
    DOUBLES: {"shm_schema", "cacheroute_proxy"},
    "bench": {*PRODUCT, TOOLS, DOUBLES, "tests"},
    "tests": {*PRODUCT, TOOLS, DOUBLES},
}
# Each role's process starts at its `__main__`: every module of its package is imported from
# there, so nothing that runs elsewhere (an offline tool, a benchmark's helper) sits in it.
ROLES = ("proxy_workers", "sidecar", "instance_agent")


def python_files(package: str) -> Iterator[Path]:
    yield from sorted((ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            yield node.lineno, prefix
            for alias in node.names:  # `from pkg import module` names a module too
                yield node.lineno, f"{prefix}.{alias.name}"


def top_level_edges() -> Iterator[tuple[str, str, str]]:
    """(importing package, imported package, where) for every import between our packages."""
    for package in TOP_LEVEL:
        for path in python_files(package):
            for line, name in imported_modules(path):
                target = name.split(".")[0]
                if target in TOP_LEVEL and target != package:
                    yield package, target, f"{path.relative_to(ROOT)}:{line} imports {name}"


def test_every_import_between_packages_follows_the_layering() -> None:
    wrong = [where for source, target, where in top_level_edges() if target not in ALLOWED[source]]
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(set(wrong)))


def test_the_allowed_package_graph_has_no_cycle() -> None:
    for a, b in itertools.permutations(ALLOWED, 2):
        assert not (b in ALLOWED[a] and a in ALLOWED[b]), f"{a} and {b} may import each other"


def test_the_product_never_names_its_doubles_or_its_tools() -> None:
    """Not even as a `-m` module string a launcher would start."""
    found = []
    for package in PRODUCT:
        for path in python_files(package):
            text = path.read_text()
            for word in (DOUBLES, f"{TOOLS}.", "bench.", "tests."):
                if f'"{word}' in text or f"'{word}" in text or f"-m {word}" in text:
                    found.append(f"{path.relative_to(ROOT)} names {word}")
    assert not found, "\n".join(found)


def test_the_product_generates_no_code() -> None:
    """No source text built and run at run time (`exec`, `eval`, the builtin `compile`): every
    path a request takes is code a reader can open, and a fast one is C beside the Python it
    mirrors (cacheroute_proxy/routing/_least_load.c, shm_schema/_lanes.c)."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno} calls {node.func.id}"
             for package in PRODUCT for path in python_files(package)
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("exec", "eval", "compile")]
    assert not found, "\n".join(found)


def test_a_private_module_is_imported_only_inside_its_package() -> None:
    """`_name` modules (the compiled parts among them) are their package's own: the router reaches
    least_load's C selector through least_load, never directly."""
    def private_module(name: str) -> str | None:
        """The package holding `name`'s first private module (a .py or a compiled .c), if any."""
        parts = name.split(".")
        for i, part in enumerate(parts[1:], 1):
            where = ROOT.joinpath(*parts[:i], part)
            if part.startswith("_") and not part.startswith("__") and (
                    where.with_suffix(".py").exists() or where.with_suffix(".c").exists()):
                return ".".join(parts[:i])
        return None

    found = []
    for package in PRODUCT:
        for path in python_files(package):
            importer = module_name(path)
            for line, name in imported_modules(path):
                owner = private_module(name)
                if owner is not None and not importer.startswith(owner + "."):
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not found, "\n".join(found)


def _imported_from(start: str, modules: dict[str, Path]) -> set[str]:
    """Every module of `modules` that `start` imports, directly or not (a function's own
    import counts: it runs in the same process), with the packages on the way."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for _, imported in imported_modules(modules[name]):
            parts = imported.split(".")
            todo.extend(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                        if m in modules and m not in seen)
    return seen


@pytest.mark.parametrize("role", ROLES)
def test_a_role_package_holds_only_what_runs_in_that_role(role: str) -> None:
    modules = {module_name(p): p for package in PRODUCT for p in python_files(package)}
    running = _imported_from(f"{role}.__main__", modules)
    idle = sorted(name for name in modules if name.split(".")[0] == role and name not in running)
    assert not idle, (f"never imported by `python -m {role}`: move what runs elsewhere out "
                      f"(offline tools to {TOOLS}/):\n" + "\n".join(idle))


def test_no_module_cycles_inside_the_product() -> None:
    modules = {module_name(p): p for package in PRODUCT for p in python_files(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # A submodule importing its own package (`from . import layout`) is how packages work.
        graph[name] = {m for _, m in imported_modules(path)
                       if m in modules and m != name and not name.startswith(m + ".")}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# --- the shared-memory formats have one owner ---------------------------------------------------
def _bit_operations(path: Path) -> Iterator[str]:
    """What a hand-decoded word looks like: a shift of a variable (a shift of two literals is
    just a constant), a mask with a literal of 16 bits or more, a shift or mask in generated
    source text."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp) and not isinstance(node, ast.Constant):
            continue
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.RShift)) and not (
                isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant)):
            yield f"{where} shifts"
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd) and any(
                isinstance(side, ast.Constant) and isinstance(side.value, int) and side.value >= 1 << 16
                for side in (node.left, node.right)):
            yield f"{where} masks with a literal"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                op in node.value for op in (">> ", "<< ", "& 4294967295", "& 0x")):
            yield f"{where} generates a shift or mask"


@pytest.mark.parametrize("package", [p for p in PRODUCT if p != "shm_schema"] + [TOOLS, DOUBLES, "tests"])
def test_no_shift_or_mask_of_a_shared_word_outside_shm_schema(package: str) -> None:
    found = [hit for path in python_files(package) if path.name != "test_layout.py"
             for hit in _bit_operations(path)]
    assert not found, "bit arithmetic belongs to shm_schema's declarations:\n" + "\n".join(found)


# --- one seam to uvicorn -------------------------------------------------------------------------
SEAM = ROOT / "cacheroute_sim" / "common" / "uvicorn_seam.py"
# Attributes of uvicorn's Server, its protocols and its request cycle that uvicorn does not
# document: only the seam (and the test that pins it) may touch them.
UVICORN_INTERNALS = {
    "server_state", "should_exit", "force_exit", "capture_signals", "install_signal_handlers",
    "handle_exit", "get_loop_factory", "setup_event_loop", "response_started", "response_complete",
    "waiting_for_100_continue", "default_headers", "message_event", "on_response", "access_log",
    "timeout_keep_alive_task", "timeout_keep_alive_handler", "close_at_deadline",
}
SEAM_TEST = ROOT / "tests" / "test_uvicorn_seam.py"


def test_only_the_seam_reaches_into_uvicorn() -> None:
    found = []
    for package in TOP_LEVEL:
        for path in python_files(package):
            if path in (SEAM, SEAM_TEST):
                continue
            for line, name in imported_modules(path):
                if name.startswith("uvicorn.") and name not in ("uvicorn.Config", "uvicorn.Server"):
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr in UVICORN_INTERNALS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses .{node.attr}")
    assert not found, "uvicorn internals outside cacheroute_sim/common/uvicorn_seam.py:\n" + "\n".join(found)


def test_the_product_does_not_run_on_uvicorn() -> None:
    """Every role serves on cacheroute_proxy/http1/; uvicorn is the simulators'."""
    found = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for package in PRODUCT for path in python_files(package)
             for line, name in imported_modules(path) if name.split(".")[0] == "uvicorn"]
    assert not found, "\n".join(found)
