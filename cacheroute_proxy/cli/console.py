"""`cacheroute-proxy console`: the interactive prompt of the original proxy's CLI.

Commands are those of commands.py, typed with or without the leading colon (`:instances --all
5` or `instances --all 5`), plus `:help [command]` and `:exit`/`:quit` (Ctrl-D too). A failing
command (a typo, a bad option, an unreachable proxy) prints why and the prompt comes back; a
watch runs until Ctrl-C, which returns to the prompt. Leaving exits with 0.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import NoReturn, TextIO

from .commands import COMMANDS, Command, execute
from .control_client import ControlPlane, ControlPlaneError
from .line_editing import LineEditing

PROMPT = "cacheroute> "
# The console's own commands: name -> (usage, summary); an empty summary is not listed by :help.
BUILTINS = {"help": ("[command]", "the commands, or one command's options"),
            "exit": ("", "leave (also :quit, Ctrl-D)"), "quit": ("", "")}
HELP_COLUMN = 46
PROBE_TIMEOUT_S = 1.0


class UsageError(Exception):
    pass


class HelpShown(Exception):
    """`-h` printed a command's help: nothing to run."""


class ConsoleParser(argparse.ArgumentParser):
    """argparse that reports instead of exiting: the console must outlive a typo."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}\nusage: {self.format_usage().partition('usage: ')[2].strip()}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            raise UsageError(message.strip())
        raise HelpShown()


def option_words(parser: argparse.ArgumentParser) -> list[str]:
    """The long options a parser takes, for Tab (argparse lists them only in `_actions`)."""
    return sorted(s for action in parser._actions for s in action.option_strings if s.startswith("--"))


class Console:
    def __init__(self, plane: ControlPlane, out: TextIO, err: TextIO, editing: LineEditing | None = None,
                 prompt: str = PROMPT) -> None:
        self.plane, self.out, self.err, self.prompt = plane, out, err, prompt
        self.parsers: dict[str, ConsoleParser] = {name: self._parser(c) for name, c in COMMANDS.items()}
        self.editing = editing

    @staticmethod
    def _parser(command: Command) -> ConsoleParser:
        parser = ConsoleParser(prog=f":{command.name}", description=command.summary)
        command.add_options(parser)
        return parser

    def completion_words(self) -> dict[str, list[str]]:
        return {name: option_words(parser) for name, parser in self.parsers.items()}

    def run(self) -> int:
        self._say(self._banner())
        try:
            while True:
                try:
                    line = input(self.prompt)
                except EOFError:  # Ctrl-D, or the end of piped input
                    if self.prompt:
                        self._say("")  # leave the shell's prompt on a line of its own
                    return 0
                except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as a shell does
                    self._say("")
                    continue
                if not self.handle(line):
                    return 0
        finally:
            if self.editing is not None:
                self.editing.close(lambda text: print(text, file=self.err))

    def handle(self, line: str) -> bool:
        """Run one line; False when it asks to leave."""
        try:
            words = shlex.split(line)
        except ValueError as exc:  # an unclosed quote
            print(f"error: {exc}", file=self.err, flush=True)
            return True
        if not words:
            return True
        name = words[0][1:] if words[0].startswith(":") else words[0]
        if name in ("exit", "quit"):
            return False
        if name == "help":
            self._help(words[1:])
            return True
        command = COMMANDS.get(name)
        if command is None:
            print(f"unknown command: {words[0]} (:help lists the commands)", file=self.err, flush=True)
            return True
        try:
            args = self.parsers[name].parse_args(words[1:])
        except UsageError as exc:
            print(f"error: {exc}", file=self.err, flush=True)
            return True
        except HelpShown:
            return True
        try:
            execute(command, self.plane, args, self.out, self.err)
        except KeyboardInterrupt:
            self._say(f"\n({command.name} stopped)")
        return True

    def _help(self, topics: list[str]) -> None:
        if topics:
            name = topics[0].lstrip(":")
            if name in self.parsers:
                self._say(self.parsers[name].format_help().rstrip())
            else:
                print(f"unknown command: {topics[0]} (:help lists the commands)", file=self.err, flush=True)
            return
        lines = ["commands (the leading colon is optional; Tab completes names and options):"]
        listed = [(c.name, c.usage, c.summary) for c in COMMANDS.values()]
        listed += [(name, usage, summary) for name, (usage, summary) in BUILTINS.items() if summary]
        lines += [f"  :{name} {usage}".ljust(HELP_COLUMN) + summary for name, usage, summary in listed]
        lines.append("add --json to status, instances, scheduler or loads for the raw JSON; "
                     ":help <command> for its options")
        self._say("\n".join(lines))

    def _banner(self) -> str:
        probe = ControlPlane(self.plane.base_url, self.plane.token, PROBE_TIMEOUT_S)
        try:
            probe.get("/healthz")
            state = "reachable"
        except ControlPlaneError as exc:
            state = f"NOT reachable now ({exc}); commands will say so until it is"
        return (f"cacheroute-proxy console: control plane {self.plane.base_url}, {state}\n"
                ":help lists the commands, :exit or Ctrl-D leaves")

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def run_console(plane: ControlPlane, out: TextIO, err: TextIO) -> int:
    # Commands from a pipe: no prompt between the outputs (nobody is there to read it).
    console = Console(plane, out, err, prompt=PROMPT if sys.stdin.isatty() else "")
    console.editing = LineEditing(console.completion_words(), list(BUILTINS))
    return console.run()
