"""`gpu-mon report`: the per-GPU and per-day tables agree (time not recorded included), one name per
column, and the plot's bar panel picks bins a reader can read, from an hour to 90 days."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPU_MON, write_config

from gpu_mon.api import historydb, summary

STATE_KEYS = [f"{c}_seconds" for c in ("harvested", "foreign", "idle", "paused", "unknown")]


def midnight() -> float:
    """Yesterday's local midnight: the hand-made history's hour is centred on it."""
    today = datetime.datetime.now().replace(hour=0, minute=0, second=0, microsecond=0)
    return (today - datetime.timedelta(days=1)).timestamp()


def hand_made(path: Path, m: float) -> None:
    """Two GPUs over [m - 1800, m + 1800): A harvests 10 min, a gap, someone else uses it across midnight
    (a preemption), the daemon cannot read it for 5 min, then nothing is recorded; B has no record at
    all; a GPU the gpus table does not know is left out of every table."""
    conn = historydb.connect_rw(str(path))
    conn.execute("INSERT INTO gpus VALUES ('GPU-a', 0, 'Sim', ?), ('GPU-b', 1, 'Sim', ?)", (m, m))
    rows = [
        ("GPU-a", "harvesting", m - 1800, m - 1200),
        ("GPU-a", "foreign", m - 300, m + 300),
        ("GPU-a", "unknown", m + 600, m + 900),
        ("GPU-gone", "harvesting", m - 1800, m + 1800),
    ]
    conn.executemany("INSERT INTO intervals (uuid, state, start, end) VALUES (?, ?, ?, ?)", rows)
    conn.execute("INSERT INTO preemptions VALUES (1, ?, 'GPU-a', 'w', 'bob', 'open', 12.0, 30.0)", (m - 300,))
    conn.close()


def report(conf: Path, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([*GPU_MON, "--config", str(conf), "report", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture
def hour(tmp_path):
    """(config, since, until as ISO local time) of the hand-made history."""
    m = midnight()
    hand_made(tmp_path / "h.sqlite", m)
    conf = write_config(tmp_path / "c.conf", f"[history]\npath = {tmp_path / 'h.sqlite'}\n")
    iso = [datetime.datetime.fromtimestamp(t).isoformat() for t in (m - 1800, m + 1800)]
    return conf, iso


def test_per_gpu_and_per_day_tables_agree_on_every_column(hour):
    conf, (since, until) = hour
    doc = json.loads(report(conf, "--since", since, "--until", until, "--json").stdout)
    a, b = doc["gpus"]
    day1, day2 = doc["days"]
    for key in STATE_KEYS:  # (unknown differed: time not recorded was left out of the days)
        assert a[key] + b[key] == day1[key] + day2[key], key
    assert [a[k] for k in STATE_KEYS] == [600.0, 600.0, 0.0, 0.0, 2400.0]
    assert a["not_recorded_seconds"] == 2100.0 and a["preemptions"] == 1
    assert [b[k] for k in STATE_KEYS] == [0.0, 0.0, 0.0, 0.0, 3600.0] and b["not_recorded_seconds"] == 3600.0
    assert [day1[k] for k in STATE_KEYS] == [600.0, 300.0, 0.0, 0.0, 2700.0] and day1["preemptions"] == 1
    assert [day2[k] for k in STATE_KEYS] == [0.0, 300.0, 0.0, 0.0, 3300.0] and day2["preemptions"] == 0
    for key in [*STATE_KEYS, "not_recorded_seconds", "preemptions"]:
        assert a[key] + b[key] == day1[key] + day2[key] == doc["total"][key], key
    assert sum(doc["total"][k] for k in STATE_KEYS) == 2 * 3600  # every GPU-second, once


def test_the_tables_total_rows_are_the_same_line_and_say_what_unknown_is(hour):
    conf, (since, until) = hour
    by_gpu = report(conf, "--since", since, "--until", until).stdout.splitlines()
    by_day = report(conf, "--since", since, "--until", until, "--by", "day").stdout.splitlines()
    assert by_gpu[0].endswith("(GPU-minutes)") and by_day[0] == by_gpu[0]
    all_gpus = next(line for line in by_gpu if line.startswith("all GPUs")).split()
    total = next(line for line in by_day if line.startswith("total")).split()
    assert all_gpus[2:8] == total[1:7] == ["10.0", "10.0", "0.0", "0.0", "100.0", "1"]
    note = "unknown: 5.0 the GPU could not be read, 95.0 not recorded (no daemon was running)"
    assert by_gpu[-1] == by_day[-1] == note


def test_one_name_per_column_in_both_tables_and_the_json(hour):
    conf, (since, until) = hour
    heads = {}
    for by in ("gpu", "day"):
        out = report(conf, "--since", since, "--until", until, "--by", by).stdout
        heads[by] = out.splitlines()[2].split()
        assert "harvesting" not in out
    shared = ["harvested", "foreign", "idle", "paused", "unknown", "preemptions"]
    assert heads["gpu"][1:7] == heads["day"][1:7] == shared
    doc = json.loads(report(conf, "--since", since, "--until", until, "--json").stdout)
    keys = [*STATE_KEYS, "not_recorded_seconds", "preemptions"]
    for row in (*doc["gpus"], *doc["days"], doc["total"]):
        assert set(keys) <= set(row) and not any(k.startswith("harvesting") for k in row), row


def synthetic(tmp_path: Path, days: float, gpus: int) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from history_synth import make

    path = str(tmp_path / "s.sqlite")
    make(path, days=days, gpus=gpus)
    return path


@pytest.mark.parametrize(
    "days, per, inner_width_days, bars",
    [
        (1 / 96, "minute", 1 / 1440, (15, 16)),
        (1 / 24, "5 minutes", 1 / 288, (12, 13)),
        (0.25, "10 minutes", 1 / 144, (36, 37)),
        (1, "hour", 1 / 24, (24, 25)),
        (7, "day", 1, (7, 8)),
        (90, "day", 1, (90, 91)),
    ],
)
def test_the_bar_panel_has_readable_bins_for_the_period(tmp_path, days, per, inner_width_days, bars):
    import matplotlib.dates as mdates

    from gpu_mon.commands import plot

    conn = historydb.connect_ro(synthetic(tmp_path, min(days, 7), 2))
    until = historydb.extent(conn)[1]
    since = until - days * 86400
    doc = summary.summarize(conn, since, until)
    fig = plot.figure(conn, doc, since, until)
    try:
        bottom = fig.axes[1]
        unit, unit_seconds = ("GPU-minutes", 60) if days <= 0.25 else ("GPU-hours", 3600)
        assert plot.bar_bins(since, until)[0] == per and bottom.get_ylabel() == f"{unit} per {per}"
        capacity, harvested = bottom.containers
        assert len(harvested) == len(capacity) and bars[0] <= len(harvested) <= bars[1]
        widths = [p.get_width() for p in harvested]
        assert all(w == pytest.approx(inner_width_days, rel=0.05) for w in widths[1:-1])  # (DST: 23/25 h)
        lefts = [p.get_x() for p in harvested]
        lo, hi = bottom.get_xlim()
        assert lefts[0] == pytest.approx(lo) and lefts[-1] + widths[-1] == pytest.approx(hi)
        if per == "day":  # the inner bars start at local midnights
            assert all(mdates.num2date(x).strftime("%H:%M") == "00:00" for x in lefts[1:])
        seconds = sum(p.get_height() for p in harvested) * unit_seconds
        assert seconds == pytest.approx(doc["total"]["harvested_seconds"], abs=1.0)  # the table's figure
        fig.canvas.draw()
        labels = [t.get_text() for t in bottom.get_xticklabels() if t.get_text()]
        assert len(labels) >= 3 and all(len(t) <= 8 for t in labels), labels  # dates, not a smear
        assert fig.axes[0].get_xlim() == (lo, hi)  # one time axis for the timeline and the bars
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
        conn.close()
