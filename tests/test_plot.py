"""scripts/plot.py and `megatrain plot`: a PNG of runs overlaid, and one-line errors."""

import json

from megatrain_jax import commands
from megatrain_jax.plot import read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(directory, scale, steps=20, eval_every=5):
    """A run directory with a synthetic metrics.jsonl (as train() writes it)."""
    directory.mkdir(parents=True)
    with open(directory / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": scale * 5 / step ** 0.5, "grad_norm": 1.0,
                      "tokens_per_sec": 1000.0 * scale, "step_time_s": 0.1,
                      "loss_smooth": scale * 5.2 / step ** 0.5}
            if step % eval_every == 0:
                record.update(eval_loss=scale * 5.5 / step ** 0.5, eval_ppl=1.0)
            f.write(json.dumps(record) + "\n")
    return directory


def test_plot_writes_a_png_of_two_runs(tmp_path, capsys):
    a, b = fake_run(tmp_path / "runs" / "a", 1.0), fake_run(tmp_path / "runs" / "b", 0.8)
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "lo')  # a torn last line, as a killed run leaves: skipped
    out = tmp_path / "plots" / "ab.png"
    assert commands.plot([str(a), str(b), "--out", str(out)]) == 0  # = scripts/plot.py
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000  # two panels with curves, not a blank
    assert [r["step"] for r in read_metrics(str(b))] == list(range(1, 21))
    # one run: the default out is in its directory; a different picture from the pair's
    assert commands.plot([str(a)]) == 0
    single = (a / "metrics.png").read_bytes()
    assert single.startswith(PNG) and single != data


def test_plot_errors_are_one_line(tmp_path, capsys):
    good = fake_run(tmp_path / "good", 1.0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    cases = [
        ([str(tmp_path / "empty")], f"error: {tmp_path / 'empty'}: no metrics.jsonl"),
        ([str(good), str(tmp_path / "missing")], f"error: {tmp_path / 'missing'}: not a directory"),
        ([str(tmp_path / "bad")], f"error: {tmp_path / 'bad' / 'metrics.jsonl'} line 2: not a "
                                  f"metrics record"),
        ([str(good), "--out", str(good / "metrics.jsonl" / "x.png")], "error: --out "),
        ([], "error: the following arguments are required: RUN_DIR"),
    ]
    for argv, message in cases:
        assert commands.plot(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), (argv, err)
    assert not (tmp_path / "empty" / "metrics.png").exists()
