"""What a reload does with [queue] (engine/reload.py): the rest applies at once; socket, database and
launcher, and a [queue] added or removed, wait for a restart."""

from __future__ import annotations

import dataclasses

from gpu_mon.config import Config, QueueSection
from gpu_mon.engine import reload


def test_socket_database_and_launcher_keep_their_old_values_the_rest_applies():
    old = QueueSection(socket="/run/a.sock", database="/var/a.sqlite", max_running_per_user=1, line=3)
    new = dataclasses.replace(
        old, socket="/run/b.sock", database="/var/b.sqlite", launcher="direct", max_running_per_user=2, line=9
    )
    applied, notes = reload.queue_on_reload(old, new)
    assert applied is not None and (applied.socket, applied.database, applied.launcher) == (
        "/run/a.sock",
        "/var/a.sqlite",
        old.launcher,
    )
    assert applied.max_running_per_user == 2
    assert notes == [
        f"[queue] {k} changes take effect when gpu-mon restarts" for k in ("socket", "database", "launcher")
    ]
    assert reload.queue_on_reload(old, dataclasses.replace(old, line=40)) == (
        dataclasses.replace(old, line=40),
        [],
    )


def test_a_queue_added_or_removed_waits_for_a_restart_and_the_reload_line_names_a_change():
    q = QueueSection()
    assert reload.queue_on_reload(None, q) == (
        None,
        ["[queue] added: the queue starts when gpu-mon restarts"],
    )
    assert reload.queue_on_reload(q, None) == (
        q,
        ["[queue] removed: the queue and its jobs keep running until gpu-mon restarts"],
    )
    assert reload.queue_on_reload(None, None) == (None, [])
    before = Config(path="x", queue=q)
    after = Config(path="x", queue=dataclasses.replace(q, order="fifo", line=12))
    assert str(reload.changes(before, after)) == "changed: [queue]"
    assert (
        str(reload.changes(before, Config(path="x", queue=dataclasses.replace(q, line=12))))
        == "nothing changed"
    )
