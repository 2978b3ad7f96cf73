"""A real terminal for tests: one tmux server on its own socket (`tmux -L <unique name>`, no
user configuration), one pane running the program under test; keys go in with send-keys, the
screen comes out with capture-pane. `close` kills that server only, never anyone else's, and
removes its socket file."""

from __future__ import annotations

import os
import shlex
import signal
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Sequence

from tests.harness import wait_until


def find_tmux() -> str | None:
    return shutil.which("tmux")


class Tmux:
    def __init__(self, argv: Sequence[str], *, cwd: Path, env: dict[str, str],
                 width: int = 200, height: int = 50) -> None:
        self.socket = f"cacheroute-test-{uuid.uuid4().hex[:12]}"
        self._env = env  # the server's environment: the pane's program inherits it
        self._run("-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
                  "-c", str(cwd), shlex.join(argv))
        # Keep the pane when the program ends, to read its exit status and last screen.
        self._run("set-option", "-t", "t", "remain-on-exit", "on")
        self.server_pid = int(self._run("display-message", "-p", "#{pid}"))
        self.socket_path = Path(self._run("display-message", "-p", "#{socket_path}").strip())

    def _run(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], env=self._env, capture_output=True,
                              text=True, timeout=10)
        if done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def send(self, *keys: str) -> None:
        """tmux key names (Enter, Tab, C-c, Up) or literal text, as send-keys takes them."""
        self._run("send-keys", "-t", "t", *keys)

    def type(self, text: str) -> None:
        self._run("send-keys", "-t", "t", "-l", text)  # -l: literal, no key-name lookup

    def screen(self, history: bool = False) -> str:
        """The visible screen (or, with history, everything the pane holds), trailing blanks cut."""
        extra = ("-S", "-", "-E", "-") if history else ()
        text = self._run("capture-pane", "-p", "-J", "-t", "t", *extra)
        return "\n".join(line.rstrip() for line in text.rstrip("\n").splitlines())

    def wait_for(self, text: str, timeout: float = 15) -> str:
        """The screen once it shows `text`."""
        def shown() -> str | None:
            screen = self.screen()
            return screen if text in screen else None
        try:
            return wait_until(shown, timeout, interval=0.1, message=f"{text!r} on the terminal")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- the screen:\n{self.screen()}") from None

    def exit_status(self) -> int | None:
        """The program's exit status once it has ended, else None."""
        # A tmux built with libutempter can miss the SIGCHLD of a pane's program that exits while
        # utempter's own handler is in place (tmux issue #311), leaving it unreaped and the pane
        # alive forever; another SIGCHLD to our own server makes it look again.
        os.kill(self.server_pid, signal.SIGCHLD)
        fields = self._run("display-message", "-p", "-t", "t", "#{pane_dead} #{pane_dead_status}").split()
        return int(fields[1]) if fields[0] == "1" and len(fields) > 1 else None

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], env=self._env, capture_output=True, timeout=10)
        self.socket_path.unlink(missing_ok=True)  # the server leaves its socket file behind
