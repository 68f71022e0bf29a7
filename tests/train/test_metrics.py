"""metrics.jsonl is a log: unreadable lines are skipped and counted, never fatal; TensorBoard mirrors it."""

import json
import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillgpt.errors import QuillError
from quillgpt.evaluate.curves import load_curves
from quillgpt.metrics_log import NUMERIC, read_log, read_metrics
from quillgpt.train.metrics import MetricsWriter, TensorBoardLog, check_tensorboard, truncate_metrics

GOOD = [
    {"step": 1, "tokens": 64, "train_loss": 4.1, "lr": 1e-3, "elapsed_s": 0.5},
    {"step": 2, "tokens": 128, "train_loss": 3.9, "lr": 1e-3, "elapsed_s": 1.0, "val_loss": 3.95},
    {"step": 3, "tokens": 192, "train_loss": 3.7, "lr": 1e-3, "elapsed_s": 1.5},
]
BAD = [
    b"caf\xe9 \xff\xfe",  # not UTF-8
    b"[1, 2, 3]",  # JSON, not an object
    b'{"step": "abc", "train_loss": 1.0}',  # non-numeric step
    b'{"step": 1e999, "train_loss": 1.0}',  # json reads 1e999 as inf
    b'{"step": 4, "train_loss": "abc"}',
    b'{"step": 4, "train_loss": NaN}',
    b'{"step": -1, "train_loss": 1.0}',
    b'{"step": true, "train_loss": 1.0}',
    b'{"train_loss": 1.0}',  # no step
    b'{"step": 4, "train_lo',  # cut by a kill
]


def write_log(path, lines):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def mixed(path):
    good = [json.dumps(r).encode() for r in GOOD]
    return write_log(path, [good[0], *BAD[:5], good[1], *BAD[5:], good[2]])


def test_unreadable_lines_are_skipped_and_counted(tmp_path):
    log = read_log(mixed(tmp_path / "metrics.jsonl"))
    assert log.records == GOOD and log.skipped == len(BAD)
    assert read_metrics(tmp_path / "metrics.jsonl") == GOOD


def test_truncate_keeps_readable_lines_up_to_the_step(tmp_path):
    path = mixed(tmp_path / "metrics.jsonl")
    assert truncate_metrics(path, after_step=2) == len(BAD)
    log = read_log(path)
    assert log.records == GOOD[:2] and log.skipped == 0
    assert truncate_metrics(tmp_path / "absent.jsonl", 5) == 0


def test_plot_reads_through_the_same_reader(tmp_path):
    mixed(tmp_path / "metrics.jsonl")
    curves = load_curves(tmp_path)
    assert curves.train == ([1.0, 2.0, 3.0], [4.1, 3.9, 3.7]) and curves.val == ([2.0], [3.95])
    assert curves.skipped == len(BAD) and curves.last_step == 3
    write_log(tmp_path / "metrics.jsonl", [b'{"step": 1}', b"\xff"])  # steps, but no losses to draw
    with pytest.raises(QuillError, match=r"no readable line with train_loss and step yet \(1 unreadable skipped\)"):
        load_curves(tmp_path)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.one_of(
                st.none(),
                st.floats(),
                st.lists(st.integers(), max_size=3),
                st.dictionaries(st.sampled_from(["step", "val_loss", "x"]), st.floats() | st.integers() | st.text(max_size=3), max_size=3),
            ).map(lambda v: json.dumps(v).encode()),
            st.fixed_dictionaries(
                {"step": st.one_of(st.integers(), st.floats(), st.text(max_size=3))},
                optional={
                    k: st.one_of(st.floats(), st.integers(), st.text(max_size=3), st.none()) for k in ("train_loss", "val_loss", "lr")
                },
            ).map(lambda v: json.dumps(v).encode()),
        ),
        max_size=8,
    )
)
def test_any_bytes_read_as_valid_records_or_skipped(tmp_path_factory, lines):
    path = tmp_path_factory.getbasetemp() / "generated_metrics.jsonl"  # rewritten by each example
    lines = [line.replace(b"\n", b" ") for line in lines]
    write_log(path, lines)
    log = read_log(path)
    assert len(log.records) + log.skipped == sum(1 for line in lines if line.strip())
    for r in log.records:
        assert isinstance(r, dict) and type(r["step"]) is int and r["step"] >= 0
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in NUMERIC if k in r)


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, tensorboard=True)
    for r in GOOD:
        writer.append({**r, "tokens_per_sec": 1000.0 * r["step"], "mfu": 0.01})
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"loss/train", "loss/val", "lr", "perf/tokens_per_sec", "perf/mfu"} <= set(events.Tags()["scalars"])
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss/train")] == [(1, 4.1), (2, 3.9), (3, 3.7)]
    assert [e.step for e in events.Scalars("loss/val")] == [2]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["tokens_per_sec"] == 1000.0


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with pytest.raises(QuillError, match=r"train.tensorboard=true needs the tensorboard package: pip install"):
        check_tensorboard()
    with pytest.raises(QuillError, match="tensorboard package"):
        TensorBoardLog(tmp_path)
