"""Console progress for the long loops (prepare rows, training steps, evaluation examples, regenerated
rows): a live rich bar with rate and ETA on a terminal, plain periodic lines everywhere else.

    with Progress("prepare train", total=len(rows), unit="rows") as bar:
        for row in rows:
            ...
            bar.advance()
    bar = Progress("train", total=max_steps, unit="steps", every=log_every, start=resumed_step)
    bar.advance(line=console_line(record))   # plain mode prints this line (+ ETA) every `every` steps

Plain lines (no ANSI codes) are printed when stdout is not a TTY (CI logs, torchrun under the launcher,
a Metaflow step) or when `DLLMFLOW_QUIET=1`; the live bar needs an interactive stdout. `every` is in
units (rows, steps); by default a line per ~10% of the total. Lives in `common` so every stage uses it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

QUIET_ENV = "DLLMFLOW_QUIET"


def is_quiet() -> bool:
    """`DLLMFLOW_QUIET` set to anything but '', '0', 'false', 'no'."""
    return os.environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no")


def live_console(stream: TextIO | None = None) -> bool:
    """A live bar only on an interactive stream and when not asked to be quiet."""
    stream = stream or sys.stdout
    return not is_quiet() and bool(getattr(stream, "isatty", lambda: False)())


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


class Progress:
    """`done` of `total` units since `start`; see the module docstring. `enabled=False` (e.g. a rank other
    than 0) prints nothing."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "rows",
        every: int | None = None,
        start: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
    ):
        self.label, self.total, self.unit = label, max(int(total), 0), unit
        self.every = max(int(every or self.total // 10 or 1), 1)
        self._auto_every = every is None  # then a crossing just short of the end waits for the last line
        self.start = self.done = int(start)
        self.enabled = enabled
        self.stream = stream
        self.t0 = time.perf_counter()
        self._live = None
        if enabled and live_console(stream or sys.stdout):
            self._live = self._start_live()

    # ---- live (rich) --------------------------------------------------------------------------------

    def _start_live(self):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import (
            Progress as RichProgress,
        )

        bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(self.unit),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=self.stream or sys.stdout),
        )
        bar.start()
        self._task = bar.add_task(self.label, total=self.total, completed=self.done, info="")
        return bar

    # ---- both -----------------------------------------------------------------------------------------

    def eta_s(self) -> float | None:
        elapsed, moved = time.perf_counter() - self.t0, self.done - self.start
        if moved <= 0:
            return None
        return max(self.total - self.done, 0) * elapsed / moved

    def advance(self, n: int = 1, *, line: str | None = None, **fields: Any) -> None:
        """`n` more units done. `fields` (loss=..., tok_s=...) show next to the bar or in the plain line;
        `line` replaces the plain line's text (the ETA is appended)."""
        before, self.done = self.done, self.done + n
        if not self.enabled:
            return
        info = " | ".join(f"{k.replace('_', '/')} {_fmt(v)}" for k, v in fields.items())
        if self._live is not None:
            self._live.update(self._task, completed=self.done, info=info)
            return
        crossed = self.done // self.every > before // self.every
        if self._auto_every and self.total - self.done < self.every:
            crossed = False
        if crossed or (self.done >= self.total > before):
            self._print(line or self.plain_line(info))

    def plain_line(self, info: str = "") -> str:
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        parts = [f"{self.label}: {self.done}/{self.total} {self.unit}{pct}"]
        if info:
            parts.append(info)
        elapsed = time.perf_counter() - self.t0
        if self.done > self.start and elapsed > 0:
            parts.append(f"{(self.done - self.start) / elapsed:,.1f} {self.unit}/s")
        return " | ".join(parts)

    def _print(self, text: str) -> None:
        eta = self.eta_s() if self.done < self.total else 0.0
        print(f"{text} | eta {format_eta(eta)}", file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
