"""The training bar (quillgpt/train/progress.py): 'evaluating…' while the val loss is measured,
and that time kept out of the bar's step rate."""

import io
import time
from types import SimpleNamespace

from quillgpt.train.progress import Progress


def test_the_bar_says_evaluating_and_keeps_evaluation_out_of_its_rate():
    t = SimpleNamespace(budget_s=None, horizon=100, step=0, elapsed_before=0.0)
    progress = Progress(t, enabled=True)
    progress.bar.close()
    progress.bar = type(progress.bar)(total=100, file=io.StringIO(), mininterval=0, smoothing=1.0)  # every update redraws
    for _ in range(3):
        time.sleep(0.02)
        progress.update(t)
    progress.set_postfix(loss="1.0000")
    with progress.evaluating():
        assert "now=evaluating…" in str(progress.bar) and "loss=1.0000" in str(progress.bar)
        time.sleep(0.5)
    assert "evaluating" not in str(progress.bar) and "loss=1.0000" in str(progress.bar)
    time.sleep(0.02)
    progress.update(t)  # the step after the evaluation: its own time, not the evaluation's
    rate = progress.bar.format_dict["rate"]
    assert rate is not None and rate > 1 / 0.25, rate  # ~1/0.02 steps/s; 2 steps/s had the 0.5 s counted
    progress.close()
