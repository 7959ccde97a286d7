"""The fleet view: a real Prometheus (Debian's `prometheus`, started here on a free port) scrapes a real
daemon on simulated GPUs with contrib/prometheus/gpu_mon.rules.yml loaded; promtool checks and unit-tests
the rules; every metric name a rule or a dashboard panel uses is one the daemon exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator, List

import pytest
from conftest import ROOT, foreign_opener_cmd, wait_for
from test_metrics import BODY, free_port, metrics_daemon

from gpu_mon.outputs import metrics

RULES = ROOT / "contrib" / "prometheus" / "gpu_mon.rules.yml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "gpu_mon.rules.test.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "gpu_mon.json"
NAME = re.compile(r"\b(gpu_mon_[a-z0-9_]+|[a-z_]+:gpu_mon_[a-z0-9_:]+)\b")


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is needed: apt-get install prometheus (.ci/run does)"
    return path


def recorded() -> List[str]:
    return re.findall(r"^\s*- record: (\S+)$", RULES.read_text(), re.M)


def rule_exprs() -> str:
    return RULES.read_text()


def dashboard_exprs() -> List[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])] + [
        v["definition"] for v in doc["templating"]["list"] if v.get("definition")
    ]


# ---------------------------------------------------------------------------------------------- static checks


def test_promtool_checks_the_rules():
    argv = [tool("promtool"), "check", "rules", str(RULES)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 8 rules found" in r.stdout


def test_promtool_unit_tests_the_rules():
    r = subprocess.run(
        [tool("promtool"), "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_name_a_rule_or_a_panel_uses_is_exported():
    exported = set(metrics.names()) | set(recorded())
    used_by_rules = set(NAME.findall(rule_exprs()))
    used_by_panels = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    assert used_by_rules and used_by_panels
    assert used_by_rules - exported == set()
    assert used_by_panels - exported == set()
    # ... and the dashboard shows what the issue asks for.
    for name in ("gpu_mon_gpu_state", "gpu_mon_preemptions_total", "gpu_mon_yield_seconds_bucket"):
        assert name in used_by_panels
    assert "gpu_mon_idle_holder_memory_bytes" in used_by_panels


def test_the_dashboard_is_grafana_json_over_a_host_variable():
    doc = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in doc["templating"]["list"]]
    assert "host" in names
    assert {p["type"] for p in doc["panels"]} >= {"state-timeline", "timeseries", "table"}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for expr in dashboard_exprs():
        if "gpu_mon_" in expr and "fleet:" not in expr and "label_values" not in expr:
            assert '$host"' in expr, expr


# ---------------------------------------------------------------------------------------------- a real server


class Prometheus:
    """A Prometheus server scraping one target every second, with the rules loaded."""

    def __init__(self, tmp: Path, target_port: int):
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {RULES}\n"
            "scrape_configs:\n  - job_name: gpu_mon\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        )
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, expr: str) -> list:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def values(self, expr: str) -> List[float]:
        try:
            return [float(s["value"][1]) for s in self.query(expr)]
        except OSError:
            return []  # not up yet

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(tmp_path) -> Iterator:
    made: List[Prometheus] = []

    def start(port: int) -> Prometheus:
        p = Prometheus(tmp_path, port)
        made.append(p)
        return p

    yield start
    for p in made:
        p.stop()


def test_prometheus_sees_a_preemption(tmp_path, sim, daemon_factory, prometheus):
    port = free_port()
    d = metrics_daemon(daemon_factory, tmp_path, port)
    prom = prometheus(port)
    u0 = sim.uuid(0)
    wait_for(
        lambda: prom.values(f'gpu_mon_preemptions_total{{uuid="{u0}"}}') == [0.0],
        timeout=90,
        what="Prometheus to scrape the daemon",
    )
    assert prom.values(f'gpu_mon_gpu_state{{uuid="{u0}", state="harvesting"}}') == [1.0]
    opener = subprocess.Popen(foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE)
    try:
        d.wait_log(r"w@0\[\d+\] stopped in")
        wait_for(
            lambda: prom.values(f'increase(gpu_mon_preemptions_total{{uuid="{u0}"}}[5m])') not in ([], [0.0]),
            timeout=60,
            what="Prometheus to see the preemption",
        )
        assert prom.values(f'gpu_mon_preemptions_total{{uuid="{u0}"}}') == [1.0]
        assert prom.values(f'gpu_mon_preemptions_total{{uuid="{sim.uuid(1)}"}}') == [0.0]
        assert prom.values("gpu_mon_yield_seconds_count") == [1.0]
    finally:
        opener.kill()
        opener.wait()
    # The recording rules run on real data, and every dashboard query is valid PromQL for this server.
    wait_for(lambda: prom.values("fleet:gpu_mon_harvest_ratio:rate5m"), timeout=60, what="a recording rule")
    for expr in dashboard_exprs():
        if not expr.startswith("label_values"):
            prom.query(expr.replace("$host", ".*").replace("$__rate_interval", "1m"))


def test_a_daemon_without_metrics_has_no_endpoint(tmp_path, sim, daemon_factory):
    d = daemon_factory(BODY)
    d.wait_running("w@0")
    assert "metrics:" not in d.log()
