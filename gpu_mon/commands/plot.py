"""`gpu-mon report --plot FILE`: a timeline per GPU colored by state with preemptions marked, and a daily bar
of harvested GPU-hours. The only module that imports matplotlib (the `gpu-mon[plot]` extra)."""

from __future__ import annotations

import datetime
import os

from gpu_mon.api import historydb
from gpu_mon.commands import base

COLORS = {
    "harvesting": "#2e7d32",
    "foreign": "#c62828",
    "idle": "#bdbdbd",
    "paused": "#f9a825",
    "unknown": "#6a1b9a",
}


def draw(conn: object, doc: dict, since: float, until: float, path: str) -> None:
    """Write the plot; CliError (exit 1) without matplotlib or for a suffix it cannot write."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".png", ".svg"):
        raise base.CliError(f"report: --plot {path!r}: the file name must end in .png or .svg")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.dates as mdates
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise base.CliError(
            "report: --plot needs matplotlib: pip install 'gpu-mon[plot]' "
            "(Debian: apt-get install python3-matplotlib)",
            1,
        ) from None
    gpus = doc["gpus"]
    spans = historydb.intervals(conn, since, until)  # type: ignore[arg-type]
    yields = historydb.preemptions(conn, since, until)  # type: ignore[arg-type]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 2.5 + 0.45 * len(gpus)), gridspec_kw={"height_ratios": [max(2, len(gpus)), 2]}
    )
    rows = {g["uuid"]: i for i, g in enumerate(gpus)}
    bars: dict = {}  # (row, state) -> [(start, width)]: one broken_barh per pair, not per interval
    for s in spans:
        if s.key in rows:
            lo = mdates.date2num(datetime.datetime.fromtimestamp(max(s.start, since)))
            hi = mdates.date2num(datetime.datetime.fromtimestamp(min(s.end, until)))
            bars.setdefault((rows[s.key], s.kind), []).append((lo, hi - lo))
    for (row, kind), pieces in bars.items():
        top.broken_barh(pieces, (row - 0.4, 0.8), color=COLORS.get(kind, "#000000"), linewidth=0)
    for when, uuid, _ms in yields:
        if uuid in rows:
            top.plot(
                datetime.datetime.fromtimestamp(when), rows[uuid] + 0.45, "v", color="black", markersize=4
            )
    top.set_yticks(range(len(gpus)), [f"GPU {g['index']}" for g in gpus])
    top.set_ylim(-0.6, len(gpus) - 0.4)
    top.invert_yaxis()
    top.set_xlim(datetime.datetime.fromtimestamp(since), datetime.datetime.fromtimestamp(until))
    top.xaxis_date()
    legend = [Patch(color=c, label=s) for s, c in COLORS.items()]
    legend.append(Patch(facecolor="white", edgecolor="#999999", label="not recorded"))
    top.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="▼ preemption")
    top.set_title(f"GPU states, {doc['since'][:16]} to {doc['until'][:16]}")
    days = doc["days"]
    bottom.bar(
        [d["day"][5:] for d in days],
        [d["harvesting_seconds"] / 3600 for d in days],
        color=COLORS["harvesting"],
    )
    bottom.set_ylabel("harvested GPU-hours")
    bottom.tick_params(axis="x", labelsize=7, rotation=45)
    fig.tight_layout()
    try:
        fig.savefig(path, format=suffix[1:])
    except OSError as err:
        raise base.CliError(f"report: cannot write {path}: {err.strerror or err}", 1) from None
    finally:
        plt.close(fig)
