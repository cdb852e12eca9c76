"""`dllmflow.common.progress`: in quiet mode or when stdout is not a TTY (CI, torchrun under the
launcher, a flow step) the progress helper prints plain periodic lines with an ETA, and no ANSI codes."""

from __future__ import annotations

import io
import re

from dllmflow.common.progress import QUIET_ENV, Progress, format_eta, is_quiet, live_console

ANSI = re.compile(r"\x1b\[")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_non_tty_prints_a_line_every_n_units_and_the_last(capsys, monkeypatch):
    monkeypatch.delenv(QUIET_ENV, raising=False)
    with Progress("prepare train", 25, unit="rows", every=10) as bar:
        for _ in range(25):
            bar.advance(loss=1.25)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == [
        "prepare train: 10/25 rows (40%)", "prepare train: 20/25 rows (80%)", "prepare train: 25/25 rows (100%)",
    ]  # fmt: skip
    assert all(" | loss 1.25 | " in ln and re.search(r"\| eta \d+:\d\d:\d\d$", ln) for ln in lines)
    assert lines[-1].endswith("eta 0:00:00") and not ANSI.search(out)


def test_quiet_env_forces_plain_lines_even_on_a_tty(monkeypatch):
    stream = _Tty()
    monkeypatch.setenv(QUIET_ENV, "1")
    assert is_quiet() and not live_console(stream)
    bar = Progress("evaluate llada", 8, unit="examples", every=4, stream=stream)
    bar.advance(4)
    bar.advance(4)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == [
        "evaluate llada: 4/8 examples (50%)", "evaluate llada: 8/8 examples (100%)",
    ]  # fmt: skip
    assert not ANSI.search(stream.getvalue())
    monkeypatch.setenv(QUIET_ENV, "0")
    assert not is_quiet() and live_console(stream)


def test_training_lines_resume_from_the_step_and_keep_the_console_line(capsys, monkeypatch):
    monkeypatch.delenv(QUIET_ENV, raising=False)
    bar = Progress("train", 30, unit="steps", every=10, start=10)  # resumed at step 10
    for step in range(11, 31):
        bar.advance(line=f"step {step}/30 | loss 2.0000 | mdlm", loss=2.0)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.rsplit(" | eta ", 1)[0] for ln in lines] == [
        "step 20/30 | loss 2.0000 | mdlm", "step 30/30 | loss 2.0000 | mdlm",
    ]  # fmt: skip


def test_disabled_prints_nothing_and_eta_format(capsys):
    bar = Progress("train", 5, unit="steps", every=1, enabled=False)
    for _ in range(5):
        bar.advance()
    assert capsys.readouterr().out == ""
    assert format_eta(3725.2) == "1:02:05" and format_eta(None) == "?"
