"""Start-up progress bars: drawn on stderr when asked (or on a terminal), absent otherwise."""

from __future__ import annotations

from outrider.progress import progress


def test_bars_draw_on_stderr_when_asked(monkeypatch, capsys):
    monkeypatch.setenv("OUTRIDER_PROGRESS", "1")
    assert list(progress(range(3), "loading weights")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "[outrider] loading weights" in err and "/3" in err  # the bar, with its total


def test_no_bars_when_off(monkeypatch, capsys):
    monkeypatch.setenv("OUTRIDER_PROGRESS", "0")
    items = [1, 2]
    assert progress(items, "x") is items
    monkeypatch.delenv("OUTRIDER_PROGRESS")
    assert progress(items, "x") is items  # pytest's stderr is no terminal
    assert capsys.readouterr().err == ""
