"""[metrics]: the textfile and the HTTP endpoint of a real daemon on simulated GPUs, checked by promtool;
config and start-up errors; a hostile scraper."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Optional

import psutil
import pytest
from conftest import GPU_MON, foreign_opener_cmd, wait_for

from gpu_mon import config
from gpu_mon.outputs import metrics

BODY = "[gpu-all]\ngpus = ALL\n\n[process-w]\ncmd = sleep 600\nper_gpu = yes\nuser = root\n"
PROMTOOL = shutil.which("promtool")  # Debian's prometheus package (.ci/run installs it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, path: str = "/metrics", host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as r:
        return r.read().decode()


def try_scrape(port: int) -> str:
    """The metrics, or "" when the server dropped the connection (all its slots were taken)."""
    try:
        return scrape(port)
    except OSError:
        return ""


def samples(text: str) -> Dict[str, float]:
    """`name{labels}` -> value, from the text format."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def value(text: str, name: str, **labels: str) -> Optional[float]:
    """The one sample of `name` whose labels include these (None when there is none yet)."""
    found = []
    for key, v in samples(text).items():
        m = re.match(r"^([A-Za-z_]+)(?:\{(.*)\})?$", key)
        assert m, key
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if m.group(1) == name and all(have.get(k) == x for k, x in labels.items()):
            found.append(v)
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def preemptions(text: str, uuid: str) -> Optional[float]:
    return value(text, "gpu_mon_preemptions_total", uuid=uuid)


def metrics_daemon(daemon_factory, tmp_path: Path, port: int, **extra: str):
    section = f"\n[metrics]\nlisten = {port}\ntextfile = {tmp_path / 'gpu_mon.prom'}\n"
    d = daemon_factory(BODY + section + "".join(f"{k} = {v}\n" for k, v in extra.items()))
    d.wait_log("metrics: serving")
    d.wait_running("w@0")
    return d


def promtool_check(text: str) -> None:
    assert PROMTOOL, "promtool is needed (apt-get install prometheus)"
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("listen = 9842", ("127.0.0.1", 9842)),
        ("listen = localhost:9842", ("127.0.0.1", 9842)),
        ("listen = 0.0.0.0:80", ("0.0.0.0", 80)),
        ("listen = [::1]:9842", ("::1", 9842)),
    ],
)
def test_listen_addresses(text, expected):
    c = config.parse(f"[metrics]\n{text}\n")
    assert c.metrics is not None and c.metrics.listen == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("listen = 0", "the port must be a number from 1 to 65535"),
        ("listen = 70000", "the port must be a number from 1 to 65535"),
        ("listen = example.org:9842", "is not PORT or ADDRESS:PORT with an IP address"),
        ("listen = ::1:9842", "is not PORT or ADDRESS:PORT"),
        ("listen = [1.2.3.4]:9842", "is not an IPv6 address"),
        ("textfile = /var/lib/x/gpu_mon.txt", "node-exporter reads only *.prom files"),
        ("port = 9842", "unknown key"),
        ("", "empty: set textfile = PATH, listen = [ADDRESS:]PORT, or both"),
    ],
)
def test_a_bad_metrics_section_is_one_line_with_its_place(text, message):
    with pytest.raises(config.ConfigError) as err:
        config.parse(f"[gpu-all]\ngpus = ALL\n[metrics]\n{text}\n", "f.conf")
    assert len(err.value.errors) == 1, err.value.errors
    assert re.match(r"f\.conf:[34]: \[metrics\]", err.value.errors[0]), err.value.errors[0]
    assert message in err.value.errors[0]


def test_no_section_no_metrics():
    assert config.parse("[gpu-all]\ngpus = ALL\n").metrics is None


def test_the_names_are_prometheus_style():
    for name in metrics.names():
        assert re.match(r"^gpu_mon_[a-z_]+$", name) or name in metrics.DCGM_NAMES
    counters = [f.name for f in metrics.Tally().families() if f.kind == "counter"]
    assert counters and all(n.endswith("_total") for n in counters)
    for f in metrics.Tally().families():
        assert "pid" not in f.labels


# ---------------------------------------------------------------------------------------------- daemon


def test_the_endpoint_and_the_textfile_show_a_preemption(tmp_path, sim, daemon_factory):
    port = free_port()
    d = metrics_daemon(daemon_factory, tmp_path, port)
    text = scrape(port)
    promtool_check(text)
    u0 = sim.uuid(0)
    assert value(text, "gpu_mon_build_info") == 1
    assert value(text, "gpu_mon_gpu_info", uuid=u0, index="0") == 1
    assert value(text, "gpu_mon_preemptions_total", uuid=u0) == 0
    harvesting = {"uuid": u0, "state": "harvesting"}
    wait_for(lambda: value(scrape(port), "gpu_mon_gpu_state", **harvesting) == 1, what="harvest")
    assert value(scrape(port), "gpu_mon_workload_running", process="w", uuid=u0) == 1
    opener = subprocess.Popen(foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE)
    try:
        assert opener.stdout is not None and opener.stdout.readline().strip() == b"open"
        d.wait_log(r"w@0\[\d+\] stopped in")
        wait_for(lambda: preemptions(scrape(port), u0) == 1, what="the preemption")
        text = scrape(port)
        assert value(text, "gpu_mon_gpu_state", uuid=u0, state="foreign") == 1
        assert value(text, "gpu_mon_workload_running", process="w", uuid=u0) == 0
        assert value(text, "gpu_mon_yield_seconds_count") == 1
        assert value(text, "gpu_mon_yield_seconds_bucket", le="10.0") == 1
        assert value(text, "gpu_mon_preemptions_total", uuid=sim.uuid(1)) == 0
        assert value(text, "gpu_mon_harvested_seconds_total", uuid=u0) > 0
        assert value(text, "gpu_mon_scan_seconds_count", kind="full") >= 1
        textfile = tmp_path / "gpu_mon.prom"
        wait_for(
            lambda: textfile.exists() and preemptions(textfile.read_text(), u0) == 1,
            what="the textfile to show the preemption",
        )
        assert textfile.stat().st_mode & 0o777 == 0o644
        promtool_check(textfile.read_text())
    finally:
        opener.kill()
        opener.wait()
    assert d.stop() == 0
    assert not (tmp_path / "gpu_mon.prom").exists(), "a stopped daemon leaves no stale textfile"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gpu_mon.")], "no temporary file left"


def test_counters_survive_a_reload_and_the_section_is_kept(tmp_path, sim, daemon_factory):
    port = free_port()
    d = metrics_daemon(daemon_factory, tmp_path, port)
    u0 = sim.uuid(0)
    wait_for(lambda: value(scrape(port), "gpu_mon_harvested_seconds_total", uuid=u0) > 0.5, what="harvest")
    before = value(scrape(port), "gpu_mon_harvested_seconds_total", uuid=u0)
    d.write_config(d.body.replace(f"listen = {port}", f"listen = {free_port()}"))
    d.signal(signal.SIGHUP)
    d.wait_log(r"reload: \[metrics\] changes take effect when gpu-mon restarts")
    d.wait_log("reloaded")
    assert value(scrape(port), "gpu_mon_harvested_seconds_total", uuid=u0) >= before


def test_a_bare_port_listens_on_loopback_only(tmp_path, sim, daemon_factory):
    port = free_port()
    metrics_daemon(daemon_factory, tmp_path, port)
    conns = psutil.net_connections("tcp")
    listening = [tuple(c.laddr) for c in conns if c.status == "LISTEN" and c.laddr[1] == port]
    assert listening == [("127.0.0.1", port)]


def test_other_paths_are_not_found_and_head_works(tmp_path, sim, daemon_factory):
    port = free_port()
    metrics_daemon(daemon_factory, tmp_path, port)
    with pytest.raises(urllib.error.HTTPError) as err:
        scrape(port, "/secret")
    assert err.value.code == 404
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and r.read() == b""
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")


def _run_fails(daemon_factory, section: str, env=None) -> str:
    d = daemon_factory(BODY + section, env=env)
    assert d.proc.wait(30) == 2
    lines = [x for x in d.log().splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in d.log()
    assert not d.state(), "nothing ran"
    return lines[0]


def test_a_port_in_use_is_one_line_and_exit_2(tmp_path, sim, daemon_factory):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        line = _run_fails(daemon_factory, f"[metrics]\nlisten = {taken.getsockname()[1]}\n")
    assert re.search(r"gpu_mon\.conf:\d+: \[metrics\] listen 127\.0\.0\.1:\d+: Address already in use$", line)


def test_an_unwritable_textfile_directory_is_one_line_and_exit_2(tmp_path, sim, daemon_factory):
    line = _run_fails(daemon_factory, f"[metrics]\ntextfile = {tmp_path}/no/such/dir/gpu_mon.prom\n")
    assert re.search(r"textfile: cannot write in .*/no/such/dir: No such file or directory$", line)
    r = subprocess.run(
        [*GPU_MON, "--config", str(tmp_path / "gpu_mon.conf"), "--sim", str(sim.path), "check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "textfile: cannot write in" in r.stderr and "Traceback" not in r.stderr


def test_without_prometheus_client_it_names_the_extra(tmp_path, sim, daemon_factory):
    blocker = tmp_path / "block"
    (blocker / "prometheus_client").mkdir(parents=True)
    (blocker / "prometheus_client" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), *sys.path])}
    line = _run_fails(daemon_factory, "[metrics]\nlisten = 1\n", env=env)
    assert "pip install 'gpu-mon[metrics]'" in line and "python3-prometheus-client" in line


def test_a_scraper_that_never_sends_a_request_does_not_stop_a_yield(tmp_path, sim, daemon_factory):
    port = free_port()
    d = metrics_daemon(daemon_factory, tmp_path, port)
    hogs = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]  # more than MAX_CLIENTS
    opener = subprocess.Popen(foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE)
    try:
        line = d.wait_log(r"w@0\[\d+\] stopped in")[0]
        ms = int(re.search(r"stopped in (\d+) ms", line).group(1))
        assert ms < 2000  # the stop itself; the yield did not wait for any scraper
    finally:
        opener.kill()
        opener.wait()
        for h in hogs:
            h.close()
    # The handlers of the closed connections free their slots as they notice (later under load); until
    # then a new connection may be one too many, and dropped: that is the cap working.
    wait_for(lambda: preemptions(try_scrape(port), sim.uuid(0)) == 1, what="a scrape after the hogs left")


def test_clients_that_hang_up_or_send_garbage_leave_no_traceback(tmp_path, sim, daemon_factory):
    port = free_port()
    d = metrics_daemon(daemon_factory, tmp_path, port)
    linger = struct.pack("ii", 1, 0)  # close with a reset, at once
    requests = (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00\xff garbage\r\n\r\n", b"GET /" * 5000)
    for request in requests:
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                with contextlib.suppress(OSError):
                    c.sendall(request)
    assert value(scrape(port), "gpu_mon_build_info") == 1
    assert "Traceback" not in d.log() and "Exception" not in d.log()


def test_an_unreadable_gpu_is_unknown_and_shows_no_stale_numbers(tmp_path, sim, daemon_factory):
    port = free_port()
    metrics_daemon(daemon_factory, tmp_path, port)
    u1 = sim.uuid(1)
    wait_for(lambda: "gpu_mon_gpu_memory_used_bytes" in scrape(port), what="a reading")
    assert value(scrape(port), "gpu_mon_gpu_memory_used_bytes", uuid=u1) == 0
    sim.set(1, error="GPU is lost")
    wait_for(lambda: value(scrape(port), "gpu_mon_gpu_state", uuid=u1, state="unknown") == 1, what="unknown")
    text = scrape(port)
    assert value(text, "gpu_mon_gpu_state", uuid=u1, state="harvesting") == 0
    assert value(text, "gpu_mon_gpu_memory_used_bytes", uuid=u1) is None
    assert value(text, "gpu_mon_gpu_utilization_ratio", uuid=u1) is None
    assert value(text, "gpu_mon_gpu_info", uuid=u1) == 1  # still a GPU it watches
    assert value(text, "gpu_mon_gpu_state", uuid=sim.uuid(0), state="harvesting") == 1


def test_a_gpu_it_does_not_watch_has_no_series(tmp_path, sim, daemon_factory):
    port = free_port()
    body = "[gpu-first]\ngpus = 0\n\n[process-w]\ncmd = sleep 600\nper_gpu = yes\nuser = root\n"
    d = daemon_factory(body + f"\n[metrics]\nlisten = {port}\n")
    d.wait_running("w@0")
    text = scrape(port)
    assert value(text, "gpu_mon_gpu_info", uuid=sim.uuid(0)) == 1
    assert sim.uuid(1) not in text  # not "unknown": not watched at all


def test_power_and_energy_in_gpu_mons_names_and_dcgm_exporters(tmp_path, sim, daemon_factory):
    sim.set(0, energy_mj=5_000_000, power_mw=250_500, name="Simulated H100")
    port = free_port()
    metrics_daemon(daemon_factory, tmp_path, port)
    u0, u1 = sim.uuid(0), sim.uuid(1)
    text = wait_for(lambda: t if value(t := scrape(port), "gpu_mon_gpu_power_watts", uuid=u0) else "")
    promtool_check(text)
    assert value(text, "gpu_mon_gpu_power_watts", uuid=u0) == 250.5
    assert value(text, "gpu_mon_gpu_energy_joules_total", uuid=u0) == 5_000.0
    dcgm = {"gpu": "0", "UUID": u0}
    assert value(text, "DCGM_FI_DEV_POWER_USAGE", **dcgm) == 250.5
    assert value(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", **dcgm) == 5_000_000
    # GPU 1 reports neither (NVML's NOT_SUPPORTED): no sample, never a 0
    assert value(text, "gpu_mon_gpu_power_watts", uuid=u1) is None
    assert value(text, "gpu_mon_gpu_energy_joules_total", uuid=u1) is None
    sim.set(0, energy_mj=5_750_000)  # the counter moves on; the next round's scrape says so
    wait_for(lambda: value(scrape(port), "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", **dcgm) == 5_750_000)


def test_the_endpoint_stops_at_once_and_lets_go_of_its_port() -> None:
    """serve_forever looks for its shutdown every 0.5 s: a stopping daemon waited that long after `gpu-mon
    stopped` (measured: 440-510 ms of its exit); our own loop wakes on a pipe."""
    from gpu_mon.outputs import exposition

    port = free_port()
    server = exposition.serve("127.0.0.1", port, lambda: b"up 1\n")
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read() == b"up 1\n"
    t = time.monotonic()
    exposition.close(server)
    assert time.monotonic() - t < 0.2
    assert server.thread is not None and not server.thread.is_alive()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # (the port is free again)
