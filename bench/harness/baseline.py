"""The product as it was at a git ref, for an A/B in one run: the tree exported (git archive:
tracked files only, no results) and run with today's interpreter and installed dependencies,
with the C extensions built here copied in where that tree's source of them is the same (an
archive has no build products: without them the tree would run the slower Python fallbacks)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from cacheroute_sim.processes import ROOT


def baseline_tree(ref: str, into: Path) -> Path:
    """The repository at `ref`, exported under `into`; SystemExit naming the ref if git cannot."""
    tree = into / f"baseline-{ref}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {ref}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree), "--exclude=bench/results"], input=archive.stdout, check=True)
    _copy_built_extensions(tree)
    return tree


def _copy_built_extensions(tree: Path, root: Path = ROOT) -> None:
    """Each extension built in `root`'s packages (`pkg/x.so`, `pkg/sub/x.so`) whose C source
    `tree` holds unchanged."""
    for built in [*root.glob("*/*.so"), *root.glob("*/*/*.so")]:
        source = built.with_name(built.name.split(".")[0] + ".c")
        theirs = tree / source.relative_to(root)
        if source.exists() and theirs.exists() and theirs.read_bytes() == source.read_bytes():
            shutil.copy2(built, tree / built.relative_to(root))


def launcher_command(tree: Path, python: str | None = None) -> tuple[tuple[str, ...], str]:
    """(arguments, program) that run that tree's launcher (`... run`; `supervisor` before the
    product package) from inside it, on `python` (else this interpreter): `python -m` puts the
    working directory first on sys.path, and the workers it starts inherit it and the
    interpreter."""
    module = "cacheroute_proxy" if (tree / "cacheroute_proxy" / "__main__.py").exists() else "supervisor"
    script = f"cd {shlex.quote(str(tree))} && exec {shlex.quote(python or sys.executable)} -m {module} run"
    return ("-c", script), "/bin/sh"
