"""Progress of a long loop: a bar on a terminal, a few plain lines in a log, or nothing.

Every loop that reports progress (training steps, pretraining the tiny base, generation,
hidden states, the teacher pipeline, synthesis, diagnose) goes through :func:`progress`, with
one rule. When the stream (stderr unless given) is a terminal, a tqdm bar is redrawn in place.
Anywhere else (a file, a pipe, a Slurm log) there is one plain line each time another tenth of
the total is done or 30 seconds have passed since the last line, whichever comes first, and a
last line when the loop ends early; a loop of 1000 updates writes about 10 lines, not 1000
redraws. In a loop that shows figures (a loss) a due line waits for the ``set_postfix`` that
follows its ``update`` (tqdm's order), so that it shows that update's figures. Disabled
(``enabled=False``: ``logging.progress: false``, ``--no-progress``, ``iga-ds demo --quiet``), it
writes nothing.

tqdm is imported only when a bar is drawn (a command line's start-up loads no third-party
library).
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

LINE_EVERY_FRACTION = 0.1  # a plain line each time another tenth of the total is done
LINE_EVERY_SECONDS = 30.0  # or this long after the last line, whichever comes first


class Progress:
    """The interface every kind shares; this one shows nothing (progress disabled)."""

    def __init__(self, total: int | None, initial: int = 0):
        self.total = total
        self.n = initial

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        """Figures shown beside the count (a loss, counts of kept and dropped), as tqdm's: called
        right after ``update``, they are that update's; ``refresh`` is tqdm's, not a figure."""

    def close(self) -> None:
        """End the display (the last line, or the bar's final state)."""

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LineProgress(Progress):
    """Plain lines for a stream that is not a terminal: see the module docstring for when."""

    def __init__(self, total: int | None, desc: str, unit: str, initial: int, stream: TextIO,
                 every_fraction: float = LINE_EVERY_FRACTION, every_seconds: float = LINE_EVERY_SECONDS):
        super().__init__(total, initial)
        self.desc, self.unit, self.stream = desc, unit, stream
        self.every_fraction, self.every_seconds = every_fraction, every_seconds
        self.start = self.last_time = time.monotonic()
        self.initial = self.last_n = initial
        self.mark = self._fraction_mark(initial)
        self.postfix = ""
        self.pending = False  # a line is due and waits for the figures of its update
        self.closed = False

    def _fraction_mark(self, n: int) -> int:
        """How many whole ``every_fraction`` steps of the total ``n`` has passed."""
        if not self.total:
            return 0
        return int(n / self.total / self.every_fraction + 1e-9)

    def update(self, n: int = 1) -> None:
        if self.pending:  # its figures never came: the line as it stood
            self._write(time.monotonic())
        self.n += n
        now = time.monotonic()
        if self._fraction_mark(self.n) > self.mark or now - self.last_time >= self.every_seconds:
            # a loop that shows figures sets this update's right after it (tqdm's order), so
            # the line waits for them rather than showing the previous update's
            self.pending = bool(self.postfix)
            if not self.pending:
                self._write(now)

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = "".join(f", {key}={value}" for key, value in values.items())
        if self.pending:
            self._write(time.monotonic())

    def close(self) -> None:
        if not self.closed and (self.pending or self.n != self.last_n):
            self._write(time.monotonic())
        self.closed = True

    def _write(self, now: float) -> None:
        elapsed = now - self.start
        if self.total:
            done = self.n - self.initial
            eta = elapsed * (self.total - self.n) / done if done > 0 else None
            count = f"{self.n}/{self.total} {self.unit} ({100.0 * self.n / self.total:.0f}%)"
            timing = f"{clock(elapsed)} elapsed" + (f", {clock(eta)} left" if eta is not None and eta > 0 else "")
        else:
            count, timing = f"{self.n} {self.unit}", f"{clock(elapsed)} elapsed"
        self.stream.write(f"{self.desc}: {count}, {timing}{self.postfix}\n")
        self.stream.flush()
        self.last_time, self.last_n, self.mark = now, self.n, self._fraction_mark(self.n)
        self.pending = False


class BarProgress(Progress):
    """A tqdm bar redrawn in place, for a terminal."""

    def __init__(self, total: int | None, desc: str, unit: str, initial: int, stream: TextIO):
        from tqdm import tqdm  # only when a bar is drawn

        super().__init__(total, initial)
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.bar.set_postfix(values, refresh=refresh)

    def close(self) -> None:
        self.bar.close()


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(total: int | None, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True,
             stream: TextIO | None = None) -> Progress:
    """The progress display of one loop: ``update(n)``, ``set_postfix(**figures)``, ``close()``
    (or ``with``). A bar when ``stream`` (default stderr) is a terminal, plain lines otherwise,
    nothing when not ``enabled``."""
    if not enabled:
        return Progress(total, initial)
    stream = stream if stream is not None else sys.stderr
    if is_terminal(stream):
        return BarProgress(total, desc, unit, initial, stream)
    return LineProgress(total, desc, unit, initial, stream)


def clock(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
