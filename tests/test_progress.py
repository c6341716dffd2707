"""Driver progress: a bar on a terminal, periodic log lines elsewhere (as under `ray job logs`)."""

import io

from cluster.schedule.progress import BarProgress, LogProgress, make_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gives_log_lines_with_rate_and_eta():
    lines = []
    progress = make_progress(100, lines.append, stream=io.StringIO())
    assert isinstance(progress, LogProgress)
    for i in range(4):
        progress.add(25, f"m/t/{i:05d}")
    progress.close()
    assert lines[0].startswith("[raysweep] 25/100 samples (25%)") and "samples/s, ETA" in lines[0]
    assert lines[-1].startswith("[raysweep] 100/100 samples (100%)") and lines[-1].endswith("last: m/t/00003")


def test_a_terminal_gets_a_bar_and_messages_above_it():
    screen, lines = Terminal(), []
    progress = make_progress(100, lines.append, stream=screen)
    assert isinstance(progress, BarProgress)
    progress.add(40, "m/t/00000")
    progress.log("[raysweep] shard m/t/00001 attempt 1 failed: boom")
    progress.add(60, "m/t/00001")
    progress.close()
    text = screen.getvalue()
    assert not lines  # messages go through the bar, not around it
    assert "[raysweep] shard m/t/00001 attempt 1 failed: boom\n" in text
    assert "100/100 samples [" in text and "samples/s" in text and "last: m/t/00001" in text


def test_while_nothing_finishes_a_line_still_comes_saying_what_is_going_on(monkeypatch):
    import cluster.schedule.progress as progress_module

    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock[0])
    lines = []
    progress = LogProgress(350, lines.append, every_s=2.0)
    for t in (100.5, 101.0, 102.5, 103.0, 104.6):  # the scheduler's ticks while engines start
        clock[0] = t
        progress.tick("2 actor(s) starting; 0 shard(s) in flight")
    assert lines == ["[raysweep] 0/350 samples (0%) ? samples/s, ETA ? — 2 actor(s) starting; 0 shard(s) in flight"] * 3
    clock[0] = 105.0
    progress.add(50, "m/t/00000")  # a result within every_s of the last line: no line
    assert len(lines) == 3


def test_the_rate_and_eta_are_the_last_half_minutes_not_the_engines_start(monkeypatch):
    """Replayed rows done at once, then engines that take 100 s to start, then 10 samples a second: no ETA that
    grows while the engines start, then one from the rate they run at."""
    import cluster.schedule.progress as progress_module

    clock = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock[0])
    lines = []
    progress = LogProgress(0, lines.append, every_s=2.0)
    clock[0] = 2.5
    progress.tick("planning")
    assert lines == ["[raysweep] no samples planned yet — planning"]
    progress.grow(1008)
    clock[0] = 3.0
    progress.add(8, "handwritten/replay/00000")
    for t in range(6, 100, 3):
        clock[0] = float(t)
        progress.tick("1 actor(s) starting; 0 shard(s) in flight")
    assert lines[-1] == ("[raysweep] 8/1008 samples (1%) ? samples/s, ETA ? — 1 actor(s) starting; "
                         "0 shard(s) in flight")
    for i in range(1, 21):  # 50 samples every 5 s
        clock[0] = 100.0 + 5 * i
        progress.add(50, f"m/t/{i:05d}")
    assert lines[-1] == "[raysweep] 1008/1008 samples (100%) 10.0 samples/s, ETA 0s — last: m/t/00020"
    assert "108/1008 samples (11%) 10.0 samples/s, ETA 90s" in lines[-19]  # the second result: 900 samples left


def test_a_sweep_done_in_one_result_ends_at_eta_0_not_an_unknown_one(monkeypatch):
    """One shard holds every sample (a GPU sweep of 100 rows): its result is the only one in the window, so no
    rate is known; the line at 100% still says the sweep has nothing left."""
    import cluster.schedule.progress as progress_module

    clock = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock[0])
    lines = []
    progress = LogProgress(100, lines.append, every_s=2.0)
    clock[0] = 60.0
    progress.add(100, "tiny/choice/00000")
    assert lines == ["[raysweep] 100/100 samples (100%) ? samples/s, ETA 0s — last: tiny/choice/00000"]
