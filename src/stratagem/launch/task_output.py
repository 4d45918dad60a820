"""What ``stratagem launch`` does with its tasks' output: every line prefixed by its task.

One selector in the supervising thread reads every child's stdout and stderr pipe, so output needs
no locks and the same loop can watch exits, deadlines and signals (see ``launcher.py``).
"""

from __future__ import annotations

import os
import selectors
import time
from typing import TextIO

from stratagem.core.cluster import TaskId

_READ_SIZE = 65536
_MAX_LINE = 65536  # a "line" longer than this is printed in pieces rather than buffered without bound
#: Prefix colours on a terminal, one per task in turn; red is left for errors.
COLORS = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta",
           "bright_green", "bright_yellow", "bright_blue", "dark_orange", "purple", "spring_green3",
           "deep_sky_blue1", "gold1", "orchid")


class Sink:
    """One output stream (our stdout or stderr) that stops accepting writes once it breaks.

    A closed pipe (``stratagem launch ... | head``) must not stop the launcher from supervising and
    reaping its tasks, so write errors are swallowed after the first one.
    """

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.broken = False

    def write(self, text: str) -> None:
        if self.broken:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # ValueError: the stream was closed
            self.broken = True


def task_prefix(task: TaskId, color: str, stream: TextIO) -> str:
    """``[worker:1] ``, coloured with rich when ``stream`` is a terminal that takes colour."""
    label = f"[{task.short}]"
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        return label + " "  # plain text for files and pipes; rich is not even imported
    from rich.console import Console
    from rich.text import Text

    console = Console(file=stream)  # honours NO_COLOR, FORCE_COLOR and TERM=dumb
    if not console.color_system:
        return label + " "
    with console.capture() as captured:
        console.print(Text(label, style=f"bold {color}"), end="")
    return captured.get() + " "


class PipeReader:
    """Turns one child pipe's bytes into prefixed lines on a sink; keeps a partial line until it ends."""

    def __init__(self, prefix: str, sink: Sink):
        self.prefix = prefix
        self.sink = sink
        self.pending = b""

    def feed(self, chunk: bytes) -> None:
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        if len(self.pending) > _MAX_LINE:
            lines.append(self.pending)
            self.pending = b""
        self._emit(lines)

    def finish(self) -> None:
        """The pipe ended: print what is left of an unterminated last line."""
        if self.pending:
            self._emit([self.pending])
            self.pending = b""

    def _emit(self, lines: list[bytes]) -> None:
        if lines:
            # rstrip: a CRLF line ending should not leave a stray carriage return after the prefix
            decoded = (line.rstrip(b"\r").decode("utf-8", "replace") for line in lines)
            self.sink.write("".join(f"{self.prefix}{text}\n" for text in decoded))


class OutputPump:
    """Reads every task's stdout and stderr pipes with one selector, in the supervising thread.

    One thread for everything keeps output handling free of locks and lets the same loop watch
    exits, deadlines and signals.
    """

    def __init__(self):
        self._selector = selectors.DefaultSelector()

    def add(self, pipe, reader: PipeReader) -> None:
        self._selector.register(pipe, selectors.EVENT_READ, reader)

    @property
    def open_pipes(self) -> int:
        return len(self._selector.get_map())

    def pump(self, timeout: float) -> None:
        """Print what has arrived, waiting up to ``timeout`` seconds for something to."""
        if not self.open_pipes:
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            try:
                chunk = os.read(key.fd, _READ_SIZE)
            except OSError:
                chunk = b""
            if chunk:
                key.data.feed(chunk)
            else:
                self._close(key)

    def drain(self, seconds: float, poll_interval: float = 0.05) -> None:
        """Read until every pipe has ended or ``seconds`` have passed.

        A pipe can stay open after its task exits if a process that escaped the task's group (it
        called setsid) still holds it; we do not wait for that forever.
        """
        deadline = time.monotonic() + seconds
        while self.open_pipes and (left := deadline - time.monotonic()) > 0:
            self.pump(min(left, poll_interval))

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            self._close(key)
        self._selector.close()

    def _close(self, key) -> None:
        key.data.finish()
        self._selector.unregister(key.fileobj)
        key.fileobj.close()
