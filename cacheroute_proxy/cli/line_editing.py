"""The console's line editing where the terminal allows it: readline's history (kept in a file,
bounded) and tab completion of command names and their options. Without readline (or without a
terminal) the console still works, with plain input()."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

HISTORY_LINES = 1000
HISTORY_FILE = "cacheroute-proxy/console_history"


def history_path(environ: dict[str, str] | None = None) -> Path:
    """$XDG_STATE_HOME/cacheroute-proxy/console_history, else under ~/.local/state (the XDG
    base-directory default for state: history is state, not configuration or cache)."""
    env = os.environ if environ is None else environ
    home = env.get("HOME") or os.path.expanduser("~")
    base = env.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state")
    return Path(base) / HISTORY_FILE


def candidates(line: str, text: str, options: dict[str, Sequence[str]], builtins: Sequence[str]) -> list[str]:
    """What `text` (the word under the cursor, `line` everything before it) may complete to:
    a command name (with the colon if one was typed) as the first word, else an option of
    that command."""
    words = line.split()
    if not words:
        colon = ":" if text.startswith(":") else ""
        bare = text[len(colon):]
        return [colon + name + " " for name in (*options, *builtins) if name.startswith(bare)]
    command = words[0].lstrip(":")
    if command == "help":  # :help <command>
        return [name + " " for name in options if name.startswith(text)] if len(words) <= 2 else []
    return [opt + " " for opt in options.get(command, ()) if opt.startswith(text)]


class LineEditing:
    """readline set up for the console; `close` saves the history."""

    def __init__(self, options: dict[str, Sequence[str]], builtins: Sequence[str],
                 path: Path | None = None) -> None:
        try:
            import readline
        except ImportError:  # e.g. a Python built without it: plain input() then
            self._readline: Any = None
            return
        self._readline = readline
        self.path = path or history_path()
        self._options, self._builtins = options, builtins
        self._matches: list[str] = []
        try:
            readline.read_history_file(self.path)
        except OSError:
            pass  # first run, or unreadable: start empty
        readline.set_history_length(HISTORY_LINES)
        readline.set_completer_delims(" \t\n")  # ':' and '-' belong to the words completed
        readline.set_completer(self._complete)
        # libedit (macOS's Python) takes another binding syntax than GNU readline.
        doc = readline.__doc__ or ""
        readline.parse_and_bind("bind ^I rl_complete" if "libedit" in doc else "tab: complete")

    @property
    def enabled(self) -> bool:
        return self._readline is not None

    def _complete(self, text: str, state: int) -> str | None:
        if state == 0:
            line = self._readline.get_line_buffer()[: self._readline.get_begidx()]
            self._matches = candidates(line, text, self._options, self._builtins)
        return self._matches[state] if state < len(self._matches) else None

    def close(self, warn: Callable[[str], None]) -> None:
        if self._readline is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._readline.write_history_file(self.path)
        except OSError as exc:
            warn(f"console history not saved to {self.path}: {exc.strerror or exc}")
