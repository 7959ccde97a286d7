"""`gpu-mon report --plot FILE`: a timeline per GPU colored by state with preemptions marked, and below it,
on the same time axis, bars of harvested GPU time (per minute to per day, by the period's length)
against all the GPUs' time. The only module that imports matplotlib (the `gpu-mon[plot]` extra)."""

from __future__ import annotations

import datetime
import os
from typing import List, Tuple

from gpu_mon.api import historydb, summary
from gpu_mon.commands import base

COLORS = {
    "harvested": "#2e7d32",
    "foreign": "#c62828",
    "idle": "#bdbdbd",
    "paused": "#f9a825",
    "unknown": "#6a1b9a",
}
_STATE_COLOR = {state: COLORS[column] for state, column in zip(summary.STATES, summary.COLUMNS)}
CAPACITY_COLOR = "#e8eaf6"


_BAR_MINUTES = ((30 * 60, "minute", 1), (2 * 3600, "5 minutes", 5), (6 * 3600, "10 minutes", 10))


def bar_bins(since: float, until: float) -> Tuple[str, List[float]]:
    """The bar panel's bins: (what one bar is, its edges): a minute up to 30 minutes, 5 minutes up to 2
    hours, 10 minutes up to 6 hours, an hour up to 3 days, a local calendar day beyond."""
    span = until - since
    for longest, per, minutes in _BAR_MINUTES:
        if span <= longest:
            return per, summary.hour_edges(since, until, minutes=minutes)
    if span <= 3 * 86400:
        return "hour", summary.hour_edges(since, until)
    return "day", summary.day_edges(since, until)


def draw(conn: object, doc: dict, since: float, until: float, path: str) -> None:
    """Write the plot; CliError (exit 1) without matplotlib or for a suffix it cannot write."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".png", ".svg"):
        raise base.CliError(f"report: --plot {path!r}: the file name must end in .png or .svg")
    plt = _pyplot()
    fig = figure(conn, doc, since, until)
    try:
        fig.savefig(path, format=suffix[1:])
    except OSError as err:
        raise base.CliError(f"report: cannot write {path}: {err.strerror or err}", 1) from None
    finally:
        plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise base.CliError(
            "report: --plot needs matplotlib: pip install 'gpu-mon[plot]' "
            "(Debian: apt-get install python3-matplotlib)",
            1,
        ) from None
    return plt


def figure(conn: object, doc: dict, since: float, until: float):
    """The figure: the timeline above, the bars below, one time axis with dates."""
    import matplotlib.dates as mdates

    plt = _pyplot()
    gpus = doc["gpus"]
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(11, 3.5 + 0.45 * len(gpus)),
        gridspec_kw={"height_ratios": [max(2, len(gpus)), 2.5]},
    )
    spans = historydb.intervals(conn, since, until)  # type: ignore[arg-type]
    _timeline(top, gpus, spans, historydb.preemptions(conn, since, until), since, until)  # type: ignore[arg-type]
    top.set_title(f"GPU states, {doc['since'][:16]} to {doc['until'][:16]}")
    _bars(bottom, [g["uuid"] for g in gpus], spans, since, until)
    locator = mdates.AutoDateLocator(minticks=4, maxticks=10)
    bottom.xaxis.set_major_locator(locator)
    bottom.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    bottom.set_xlim(_num(since), _num(until))
    fig.tight_layout()
    return fig


def _num(wall: float) -> float:
    import matplotlib.dates as mdates

    return float(mdates.date2num(datetime.datetime.fromtimestamp(wall)))


def _timeline(ax, gpus: List[dict], spans, yields, since: float, until: float) -> None:
    from matplotlib.patches import Patch

    rows = {g["uuid"]: i for i, g in enumerate(gpus)}
    bars: dict = {}  # (row, state) -> [(start, width)]: one broken_barh per pair, not per interval
    for s in spans:
        if s.key in rows:
            lo, hi = _num(max(s.start, since)), _num(min(s.end, until))
            bars.setdefault((rows[s.key], s.kind), []).append((lo, hi - lo))
    for (row, kind), pieces in bars.items():
        ax.broken_barh(pieces, (row - 0.4, 0.8), color=_STATE_COLOR.get(kind, "#000000"), linewidth=0)
    for when, uuid, _ms in yields:
        if uuid in rows:
            ax.plot(_num(when), rows[uuid] + 0.45, "v", color="black", markersize=4)
    ax.set_yticks(range(len(gpus)), [f"GPU {g['index']}" for g in gpus])
    ax.set_ylim(-0.6, len(gpus) - 0.4)
    ax.invert_yaxis()
    legend = [Patch(color=c, label=s) for s, c in COLORS.items()]
    legend.append(Patch(facecolor="white", edgecolor="#999999", label="not recorded"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="▼ preemption")


def bar_unit(since: float, until: float) -> Tuple[str, float]:
    """The bars' unit, as the report's table has it: GPU-minutes up to 6 hours, GPU-hours beyond."""
    return ("GPU-minutes", 60.0) if until - since <= 6 * 3600 else ("GPU-hours", 3600.0)


def _bars(ax, uuids: List[str], spans, since: float, until: float) -> None:
    """Harvested GPU time per bin, in front of the GPU time all the GPUs had in it (a partial bin at
    either end of the period is shorter)."""
    per, edges = bar_bins(since, until)
    unit, seconds = bar_unit(since, until)
    grid = summary.cells(uuids, spans, edges)
    left = [_num(t) for t in edges[:-1]]
    width = [_num(b) - _num(a) for a, b in zip(edges, edges[1:])]
    had = [(b - a) * len(uuids) / seconds for a, b in zip(edges, edges[1:])]
    harvested = [sum(g["harvested"] for g in row.values()) / seconds for row in grid]
    look = {"width": width, "align": "edge", "edgecolor": "white", "linewidth": 0.5}
    ax.bar(left, had, color=CAPACITY_COLOR, label="all GPUs' time", **look)
    ax.bar(left, harvested, color=COLORS["harvested"], label="harvested", **look)
    ax.set_ylabel(f"{unit} per {per}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
