"""Long loops show progress: a tqdm bar in a terminal, plain lines in a log (no terminal)."""

import io

from hobson.progress import Progress, progress, reporter


def test_plain_lines_without_a_terminal_at_most_every_interval_and_at_the_end():
    out = io.StringIO()
    assert list(progress(range(5), desc="rl updates", every_s=1e9, file=out, tty=False)) == [0, 1, 2, 3, 4]
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[hobson] rl updates: 5/5 (")  # only the end
    out = io.StringIO()
    list(progress(range(3), desc="x", every_s=0, file=out, tty=False))
    assert [ln.split(" (")[0] for ln in out.getvalue().splitlines()] == [
        "[hobson] x: 1/3", "[hobson] x: 2/3", "[hobson] x: 3/3"]


def test_a_terminal_gets_a_tqdm_bar():
    out = io.StringIO()
    bar = Progress(4, "train steps", file=out, tty=True)
    bar.set(2)
    bar.set(4)
    bar.close()
    assert "train steps" in out.getvalue() and "4/4" in out.getvalue()


def test_reporter_for_labelling_batches(capsys):
    on_batch = reporter("teacher shard 0 batches")
    for done in (1, 2):
        on_batch(done, 2)
    assert "[hobson] teacher shard 0 batches: 2/2" in capsys.readouterr().err
