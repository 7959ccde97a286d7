"""Prometheus metrics ([metrics]): a round listener that counts what the daemon sees and does, exposed as a
textfile for node-exporter's textfile collector, an HTTP endpoint, or both (outputs/exposition.py renders and
serves them; it is the only module that imports prometheus_client).

The loop's side only updates plain numbers and swaps in a new immutable tuple of families: rendering the text
format and all I/O happen in other threads, so neither a slow disk nor a slow scraper can delay a yield.
Counters live as long as the process (they survive a SIGHUP); Prometheus handles the reset at a restart.
Names follow Prometheus' conventions (base units, `_total` counters, ratios 0-1) and join dcgm-exporter's
series on `uuid`; no label carries a pid (it would make a new series every restart).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Dict, List, Optional, Tuple

from gpu_mon import __version__, safefile
from gpu_mon.config import MetricsSection
from gpu_mon.outputs.families import Family, MetricsError
from gpu_mon.policy import gpustate
from gpu_mon.policy.report import RoundReport
from gpu_mon.queue import jobs as J
from gpu_mon.queue.runs import PREEMPTED, QueueReport
from gpu_mon.slurm.view import SlurmReport

log = logging.getLogger("gpu_mon")
MIB = 1 << 20
# Foreign open to stop signal: ms when the open is seen, up to interval_seconds when only a poll sees it.
YIELD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SCAN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Submission (or requeue) to start of a queued job: a second to a day.
WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0)
TEXTFILE_MIN_GAP = 1.0  # seconds between two writes of the textfile (a round can come every few ms)


class Histogram:
    """Bucket counts, a sum and nothing else (the loop's thread only)."""

    def __init__(self, bounds: Tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value (le: a value equal to a bound falls in that bound's bucket)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def value(self) -> Tuple[Tuple[int, ...], float]:
        """(cumulative counts, sum)."""
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return tuple(out), self.sum


@dataclass
class _GpuTally:
    index: str = ""
    name: str = ""
    state: str = "unknown"
    memory_used: Optional[float] = None
    memory_total: Optional[float] = None
    utilization: Optional[float] = None
    power_mw: Optional[int] = None  # NVML's, milliwatts (None: not reported: no sample)
    energy_mj: Optional[int] = None  # NVML's total energy counter, millijoules since the driver loaded
    harvested: float = 0.0
    foreign: float = 0.0
    preemptions: int = 0


class Tally:
    """Everything the metrics show, updated once a round; `families()` is an immutable snapshot of it."""

    def __init__(self) -> None:
        self.gpus: Dict[str, _GpuTally] = {}
        self.last_now: Optional[float] = None
        self.running: Dict[Tuple[str, str], int] = {}
        self.restarts: Dict[str, int] = {}
        self.tty_paused = 0
        self.idle_memory: Dict[Tuple[str, str], float] = {}
        self.yields = Histogram(YIELD_BUCKETS)
        self.scans: Dict[str, Histogram] = {}
        self.slurm: Optional[SlurmReport] = None  # [slurm]: its families are shown only with the section
        self.queue_on = False  # [queue]: its families are shown only with a queue
        self.queue_jobs: Dict[str, int] = dict.fromkeys(J.STATES, 0)
        self.waits = Histogram(WAIT_BUCKETS)
        self.job_preemptions = 0

    def update(self, report: RoundReport) -> None:
        """Count one round."""
        self._seconds(report.snapshot.now)
        self._gpus(report)
        self._workloads(report)
        for p in report.preemptions:
            self._gpu(p.uuid).preemptions += 1
            self.yields.observe(max(0.0, p.term_ms) / 1000.0)
        for mode, seconds in report.scans:
            self.scans.setdefault(mode, Histogram(SCAN_BUCKETS)).observe(seconds)
        self.tty_paused = int(bool(report.decision.paused_by))
        idle: Dict[Tuple[str, str], float] = {}
        for h in report.idle_holders:
            idle[(h.uuid, h.user)] = idle.get((h.uuid, h.user), 0.0) + h.memory_mib * MIB
        self.idle_memory = idle
        self._queue(report.queue)  # type: ignore[arg-type]
        self.slurm = report.slurm  # type: ignore[assignment]

    def _queue(self, queue: Optional[QueueReport]) -> None:
        self.queue_on = queue is not None
        if queue is None:
            return
        self.queue_jobs = {s: queue.counts.get(s, 0) for s in J.STATES}
        for run in queue.started:
            if not run.earlier:  # (an earlier daemon's run was counted by that daemon)
                self.waits.observe(run.wait)
        self.job_preemptions += sum(1 for run in queue.ended if run.how == PREEMPTED)

    def _slurm_families(self) -> Tuple[Family, ...]:
        s = self.slurm or SlurmReport()
        return (
            Family(
                "gpu_mon_slurm_actions_total",
                "counter",
                "Calls asking Slurm to signal, requeue or cancel a preemptible job, by result "
                "(ok, failed, unreachable, gone: the job had ended).",
                ("action", "result"),
                tuple(((a, r), n) for a, r, n in s.counts),
            ),
            Family(
                "gpu_mon_slurm_unreachable",
                "gauge",
                "1 while the last call to Slurm found slurmctld unreachable.",
                (),
                (((), int(s.unreachable)),),
            ),
            Family(
                "gpu_mon_slurm_unreachable_episodes_total",
                "counter",
                "Times Slurm became unreachable.",
                (),
                (((), s.episodes),),
            ),
        )

    def _gpu(self, uuid: str) -> _GpuTally:
        return self.gpus.setdefault(uuid, _GpuTally())

    def _seconds(self, now: float) -> None:
        """The time since the last round goes to the state each GPU was in during it."""
        if self.last_now is not None and now > self.last_now:
            dt = now - self.last_now
            for g in self.gpus.values():
                if g.state == "harvesting":
                    g.harvested += dt
                elif g.state == "foreign":
                    g.foreign += dt
        self.last_now = now

    def _gpus(self, report: RoundReport) -> None:
        # The GPUs it watches ([gpu-*]): one it does not is none of its business (and would be "unknown").
        watched = set(getattr(report.plan, "rules", {}))
        for uuid in set(self.gpus) - watched:
            del self.gpus[uuid]  # no longer watched (a reload)
        for uuid in watched:
            self._gpu(uuid)
        seen = [g for g in report.snapshot.reading.gpus if g.uuid in watched]
        for g in seen:
            t = self.gpus[g.uuid]
            t.index, t.name = str(g.index), g.name or ""
            t.memory_used = None if g.memory_used_mib is None else g.memory_used_mib * MIB
            t.memory_total = None if g.memory_total_mib is None else g.memory_total_mib * MIB
            t.utilization = None if g.utilization_pct is None else g.utilization_pct / 100.0
            t.power_mw, t.energy_mj = g.power_mw, g.energy_mj
        unseen = set(self.gpus) - {g.uuid for g in seen}
        for uuid in unseen:  # not read this round: nothing known of it now (unsure counts as unknown)
            t = self.gpus[uuid]
            t.memory_used = t.utilization = t.power_mw = t.energy_mj = None
        states = gpustate.round_states(report.decision, report.workloads, list(self.gpus))
        for uuid, (state, _detail) in states.items():
            self.gpus[uuid].state = state

    def _workloads(self, report: RoundReport) -> None:
        live = {w["key"] for w in report.workloads if not w.get("stopping")}
        running: Dict[Tuple[str, str], int] = {}
        for inst in getattr(report.plan, "instances", ()):
            for uuid in inst.gpus:
                running[(inst.process, uuid)] = int(inst.key in live)
        self.running = running
        for event in report.decision.events:
            process = event.exited.key.split("@", 1)[0]
            self.restarts[process] = self.restarts.get(process, 0) + 1
        for process in {p for p, _u in running}:
            self.restarts.setdefault(process, 0)

    def families(self) -> Tuple[Family, ...]:
        """A snapshot for the exposition threads."""
        queue = self._queue_families() if self.queue_on else ()
        slurm = self._slurm_families() if self.slurm is not None else ()
        return (*self._gpu_families(), *self._work_families(), *self._histograms(), *queue, *slurm)

    def _gpu_families(self) -> Tuple[Family, ...]:
        g = sorted(self.gpus.items())
        states = tuple(((u, s), int(t.state == s)) for u, t in g for s in gpustate.STATES)
        return (
            Family(
                "gpu_mon_build_info",
                "gauge",
                "gpu-mon's version (always 1).",
                ("version",),
                (((__version__,), 1),),
            ),
            Family(
                "gpu_mon_gpu_info",
                "gauge",
                "Each GPU gpu-mon watches (always 1); index is NVML's.",
                ("uuid", "index", "name"),
                tuple(((u, t.index, t.name), 1) for u, t in g),
            ),
            Family(
                "gpu_mon_gpu_state",
                "gauge",
                "1 for the GPU's current state, 0 for the others.",
                ("uuid", "state"),
                states,
            ),
            _gauge("gpu_mon_gpu_memory_used_bytes", "GPU memory in use, by anyone.", g, "memory_used"),
            _gauge("gpu_mon_gpu_memory_total_bytes", "GPU memory.", g, "memory_total"),
            _gauge("gpu_mon_gpu_utilization_ratio", "GPU utilization, 0-1.", g, "utilization"),
            *_energy_families(g),
            Family(
                "gpu_mon_harvested_seconds_total",
                "counter",
                "Time a workload of gpu-mon ran on the GPU.",
                ("uuid",),
                tuple(((u,), t.harvested) for u, t in g),
            ),
            Family(
                "gpu_mon_foreign_seconds_total",
                "counter",
                "Time someone else used the GPU.",
                ("uuid",),
                tuple(((u,), t.foreign) for u, t in g),
            ),
            Family(
                "gpu_mon_preemptions_total",
                "counter",
                "Workloads stopped because another user took the GPU.",
                ("uuid",),
                tuple(((u,), t.preemptions) for u, t in g),
            ),
        )

    def _work_families(self) -> Tuple[Family, ...]:
        idle = tuple(((u, user), b) for (u, user), b in sorted(self.idle_memory.items()))
        return (
            Family(
                "gpu_mon_workload_running",
                "gauge",
                "1 while the workload runs on the GPU, else 0.",
                ("process", "uuid"),
                tuple(((p, u), v) for (p, u), v in sorted(self.running.items())),
            ),
            Family(
                "gpu_mon_workload_restarts_total",
                "counter",
                "Times a workload ended on its own (crash or exit) and was restarted after a backoff.",
                ("process",),
                tuple(((p,), n) for p, n in sorted(self.restarts.items())),
            ),
            Family(
                "gpu_mon_tty_paused",
                "gauge",
                "1 while an active terminal user pauses all work.",
                (),
                (((), self.tty_paused),),
            ),
            Family(
                "gpu_mon_idle_holder_memory_bytes",
                "gauge",
                "GPU memory held by another user's process idle for idle_holder_seconds.",
                ("uuid", "user"),
                idle,
            ),
        )

    def _histograms(self) -> Tuple[Family, ...]:
        scans = tuple(((k,), h.value()) for k, h in sorted(self.scans.items()))
        return (
            Family(
                "gpu_mon_yield_seconds",
                "histogram",
                "From a foreign process opening the GPU to the workload's stop signal.",
                (),
                (((), self.yields.value()),),
                YIELD_BUCKETS,
            ),
            Family(
                "gpu_mon_scan_seconds",
                "histogram",
                "Holder scans of /proc, by kind.",
                ("kind",),
                scans,
                SCAN_BUCKETS,
            ),
        )

    def _queue_families(self) -> Tuple[Family, ...]:
        return (
            Family(
                "gpu_mon_queue_jobs",
                "gauge",
                "Jobs of the queue in each state.",
                ("state",),
                tuple(((s,), n) for s, n in self.queue_jobs.items()),
            ),
            Family(
                "gpu_mon_queue_wait_seconds",
                "histogram",
                "From a job's submission (or its return to the queue) to its start.",
                (),
                (((), self.waits.value()),),
                WAIT_BUCKETS,
            ),
            Family(
                "gpu_mon_job_preemptions_total",
                "counter",
                "Runs of queued jobs stopped because someone else took one of their GPUs.",
                (),
                (((), self.job_preemptions),),
            ),
        )


# dcgm-exporter's names for the same two figures, in its units and labels (`gpu`: NVML's index, `UUID`;
# not its `modelName`, which promtool's lint refuses: gpu_mon_gpu_info has the name), so dashboards and
# queries written for it read gpu-mon's too. Exposed as gauges: the
# exporter calls the energy a counter without `_total`, which prometheus_client cannot write; PromQL's
# rate() and increase() work on it all the same.
DCGM_NAMES = ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")


def _energy_families(gpus: List[Tuple[str, _GpuTally]]) -> Tuple[Family, ...]:
    """Each GPU's power and energy counter (no sample where NVML has no figure), in gpu-mon's names and
    units and in dcgm-exporter's."""
    power = [(u, t, t.power_mw) for u, t in gpus if t.power_mw is not None]
    energy = [(u, t, t.energy_mj) for u, t in gpus if t.energy_mj is not None]
    dcgm = ("gpu", "UUID")
    return (
        Family(
            "gpu_mon_gpu_power_watts",
            "gauge",
            "GPU power draw (NVML), watts.",
            ("uuid",),
            tuple(((u,), mw / 1000.0) for u, _t, mw in power),
        ),
        Family(
            "gpu_mon_gpu_energy_joules_total",
            "counter",
            "GPU energy since the driver loaded (NVML; Volta and newer data-centre GPUs), joules.",
            ("uuid",),
            tuple(((u,), mj / 1000.0) for u, _t, mj in energy),
        ),
        Family(
            DCGM_NAMES[0],
            "gauge",
            "Power usage for the device in Watts (as dcgm-exporter names it).",
            dcgm,
            tuple(((t.index, u), mw / 1000.0) for u, t, mw in power),
        ),
        Family(
            DCGM_NAMES[1],
            "gauge",
            "Total energy consumption since the driver loaded, in mJ (as dcgm-exporter names it).",
            dcgm,
            tuple(((t.index, u), mj) for u, t, mj in energy),
        ),
    )


def _gauge(name: str, text: str, gpus: List[Tuple[str, _GpuTally]], field: str) -> Family:
    """A per-GPU gauge, without a sample for a GPU whose value is unknown now."""
    values = ((u, getattr(t, field)) for u, t in gpus)
    return Family(name, "gauge", text, ("uuid",), tuple(((u,), v) for u, v in values if v is not None))


def names() -> Tuple[str, ...]:
    """Every metric name the daemon exports, as a query sees it (with _bucket, _sum, _count)."""
    out: List[str] = []
    tally = Tally()
    tally.queue_on = True
    tally.slurm = SlurmReport()
    for f in tally.families():
        out += [f"{f.name}_bucket", f"{f.name}_sum", f"{f.name}_count"] if f.kind == "histogram" else [f.name]
    return tuple(out)


class Metrics:
    """Round listener: counts each round; the textfile and HTTP threads expose the latest count."""

    def __init__(self, settings: MetricsSection):
        self.settings = settings
        self.tally = Tally()
        self.current: Tuple[Family, ...] = self.tally.families()
        self.render: Optional[Callable[[Tuple[Family, ...]], bytes]] = None
        self.rendered: Tuple[Optional[Tuple[Family, ...]], bytes] = (None, b"")
        self.render_lock = threading.Lock()
        self.server: Optional[object] = None
        self.textfile: Optional[_TextfileWriter] = None

    def open(self) -> None:
        """Before the first round: import the extra, bind the endpoint, check the textfile's directory.
        Raise MetricsError (one line) when one of them is impossible."""
        exposition = load_exposition()
        self.render = exposition.render
        if self.settings.textfile:
            check_textfile_dir(self.settings.textfile)
            self.textfile = _TextfileWriter(self.settings.textfile, self.text)
        if self.settings.listen:
            host, port = self.settings.listen
            self.server = exposition.serve(host, port, self.text)
            log.info("metrics: serving http://%s/metrics", self.settings.listen_text)
        if self.textfile is not None:
            self.textfile.start()
            log.info("metrics: writing %s", self.settings.textfile)

    def text(self) -> bytes:
        """The text format of the latest count, rendered once per round whatever the number of readers
        (rendering holds the interpreter's lock a millisecond or so: 20 scrapes a second each rendering
        anew measurably slowed yields)."""
        with self.render_lock:
            families, data = self.rendered
            current = self.current
            if families is not current:
                assert self.render is not None
                data = self.render(current)
                self.rendered = (current, data)
            return data

    def on_round(self, report: RoundReport) -> None:
        """Count the round; wake the textfile writer."""
        self.tally.update(report)
        self.current = self.tally.families()
        if self.textfile is not None:
            self.textfile.wake()

    def on_event(self, event: str) -> None:
        """`stopped`: close the endpoint; remove the textfile (a stopped daemon has no current metrics)."""
        if event != "stopped":
            return
        if self.server is not None:
            from gpu_mon.outputs import exposition

            exposition.close(self.server)
            self.server = None
        if self.textfile is not None:
            self.textfile.close()
            self.textfile = None

    def deadline(self) -> Optional[float]:
        """No timer."""
        return None


def load_exposition() -> ModuleType:
    """outputs/exposition.py, or MetricsError naming the extra when prometheus_client is missing."""
    try:
        from gpu_mon.outputs import exposition
    except ImportError as err:
        raise MetricsError(
            f"[metrics] needs the Python package prometheus_client ({err}): "
            "pip install 'gpu-mon[metrics]' (Debian, Ubuntu: apt install python3-prometheus-client)"
        ) from None
    return exposition


def check_textfile_dir(path: str) -> None:
    """MetricsError unless a file can be created next to `path` (as the textfile will be, then renamed)."""
    directory = os.path.dirname(path) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=".gpu_mon.", suffix=".check", dir=directory)
    except OSError as err:
        why = err.strerror or err
        raise MetricsError(f"[metrics] textfile: cannot write in {directory}: {why}") from None
    os.close(fd)
    os.unlink(tmp)


class _TextfileWriter:
    """A thread that writes the latest exposition to the textfile when it changed, atomically, at most once
    every TEXTFILE_MIN_GAP seconds."""

    def __init__(self, path: str, text: Callable[[], bytes]):
        self.path, self.text = path, text
        self.wanted = threading.Event()
        self.closing = threading.Event()
        self.written = b""
        self.failed_said = False
        self.thread = threading.Thread(target=self.run, name="metrics-textfile", daemon=True)

    def start(self) -> None:
        """Start the thread (it writes at once)."""
        self.wanted.set()
        self.thread.start()

    def wake(self) -> None:
        """There may be something new to write."""
        self.wanted.set()

    def run(self) -> None:
        """Until close: wait for a round, write if the text changed, rest a moment."""
        while not self.closing.is_set():
            self.wanted.wait()
            self.wanted.clear()
            if self.closing.is_set():
                return
            self.write_if_changed()
            self.closing.wait(TEXTFILE_MIN_GAP)

    def write_if_changed(self) -> None:
        """Render; replace the file if the text differs from what was written."""
        text = self.text()
        if text == self.written:
            return
        try:
            safefile.replace(self.path, text)
        except OSError as err:
            if not self.failed_said:
                self.failed_said = True
                log.warning("metrics: cannot write %s: %s (trying again)", self.path, err.strerror or err)
            return
        self.written, self.failed_said = text, False

    def close(self) -> None:
        """Stop the thread and remove the file."""
        self.closing.set()
        self.wanted.set()
        self.thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
