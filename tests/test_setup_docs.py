"""The README's set-up commands: CI runs exactly the documented test command, and that command installs only
what the tests use (no recommended packages, no init system, the CPU build of the pinned torch)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def ci_command() -> str:
    (line,) = [x for x in (ROOT / ".ci" / "run").read_text().splitlines() if x.startswith("export ")]
    return line


def test_ci_runs_the_readme_command():
    assert f"```sh\n{ci_command()}\n```" in README


def test_apt_installs_no_recommends_and_no_init_system():
    apt = re.search(r"apt-get install ([^&]*)&&", ci_command())
    assert apt, ci_command()
    words = apt.group(1).split()
    assert "--no-install-recommends" in words
    assert not {"systemd-sysv", "init", "prometheus-node-exporter"} & set(words)


def test_torch_comes_from_the_cpu_index_at_the_tested_pin():
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    (pin,) = [x for x in extras["options.extras_require"]["test"].split() if x.startswith("torch")]
    step = f"pip install --no-deps {pin} --index-url https://download.pytorch.org/whl/cpu &&"
    assert step in ci_command()
    assert ci_command().index(step) < ci_command().index("pip install -e '.[test]'")
