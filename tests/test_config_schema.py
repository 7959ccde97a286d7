"""The config schema (gpu_mon/config/schema*.py) against everything that describes the config: the
parser's defaults, conf/gpu_mon.conf's comments, gpu_mon.conf(5). A key added in one place and not the
others fails here."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from gpu_mon import config
from gpu_mon.config import manpage, schema

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "conf" / "gpu_mon.conf"
PAGE = ROOT / manpage.OUTPUT
ALL_KEYS = [(spec, key) for spec in schema.SECTIONS for key in spec.keys]
KEY_IDS = [f"{spec.name}.{key.name}" for spec, key in ALL_KEYS]
# The dataclass each kind of section becomes.
MODEL = {
    "defaults": config.Defaults,
    "gpu-NAME": config.GpuSection,
    "process-NAME": config.ProcessSection,
    "tty": config.TtySection,
    "history": config.HistorySection,
    "metrics": config.MetricsSection,
    "sentinel": config.SentinelSection,
    "occupy": config.OccupySection,
    "queue": config.QueueSection,
    "slurm": config.SlurmSection,
}
# Keys whose value is resolved into other fields: `group =` is the user's primary group (a name found then).
RESOLVED = {("process-NAME", "group")}


def shipped_keys() -> Dict[str, List[Tuple[str, str]]]:
    """conf/gpu_mon.conf's keys, written or commented out (`;key = value`), by kind of section."""
    found: Dict[str, List[Tuple[str, str]]] = {}
    kind = None
    for line in SHIPPED.read_text().splitlines():
        header = re.match(r"^;?\[([a-z]+)(-[a-z0-9]+)?\]$", line)
        if header:
            kind = header.group(1) + ("-NAME" if header.group(2) else "")
            found.setdefault(kind, [])
            continue
        item = re.match(r"^;?([a-z_]+) =(.*)$", line)
        if item and kind:
            found[kind].append((item.group(1), item.group(2).strip()))
    return found


def test_the_sections_are_the_parsers():
    names = [spec.name for spec in schema.SECTIONS]
    assert sorted(names) == sorted(MODEL)
    with pytest.raises(config.ConfigError, match=r"known: \[defaults\]"):
        config.parse("[nope]\n")  # (the parser's list of kinds: every one has a spec)
    for spec in schema.SECTIONS:
        assert spec.doc and len(spec.keys) == len({k.name for k in spec.keys}), spec.name


@pytest.mark.parametrize(("spec", "key"), ALL_KEYS, ids=KEY_IDS)
def test_every_key_has_a_doc_a_type_and_a_default_the_parser_agrees_with(spec, key):
    assert key.doc.strip() and key.type.strip() and "\n" not in key.doc
    parse = key.parser("/etc")
    field = {f.name: f for f in dataclasses.fields(MODEL[spec.name])}.get(key.name)
    if key.required or (spec.name, key.name) in RESOLVED:
        pass
    elif key.default:
        assert field is not None, "a key with a default is a field of its section"
        assert parse(key.default) == field.default
    else:  # not set by default: the field says so
        assert field is not None and field.default in (None, ())
    if key.example:
        parse(key.example)  # a ValueError fails the test: examples are valid


@pytest.mark.parametrize(("spec", "key"), ALL_KEYS, ids=KEY_IDS)
def test_every_key_is_read_by_the_parser(spec, key):
    header = spec.name.replace("NAME", "x")
    required = "".join(f"{k.name} = {k.example}\n" for k in spec.keys if k.required and k is not key)
    value = key.example or key.default or "ALL"
    text = f"[{header}]\n{required}{key.name} = {value}\n"
    if spec.name == "slurm" and key.name not in ("preemptible_partitions", "preemptible_qos"):
        text += "preemptible_qos = low\n"
    if spec.name == "sentinel" and key.name == "command":
        text += "kill_action = command\n"
    try:
        config.parse(text, "/etc/gpu_mon.conf")
    except config.ConfigError as err:
        assert not [e for e in err.errors if "unknown key" in e], err.errors


def test_shipped_config_documents_every_key_and_no_other():
    """conf/gpu_mon.conf lists each key of each section once (`;key = default`), and nothing unknown."""
    shipped = shipped_keys()
    assert sorted(shipped) == sorted(spec.name for spec in schema.SECTIONS)
    for spec in schema.SECTIONS:
        written = [name for name, _ in shipped[spec.name]]
        known = [key.name for key in spec.keys]
        assert sorted(written) == sorted(known), f"[{spec.name}]: conf/gpu_mon.conf and the schema differ"


def test_shipped_config_shows_each_keys_default_or_example():
    for spec in schema.SECTIONS:
        for name, shown in shipped_keys()[spec.name]:
            key = spec.key(name)
            assert shown in (key.default, key.example), f"[{spec.name}] {name} = {shown!r}"


def test_the_man_page_is_generated_from_the_schema_and_up_to_date():
    """`python -m gpu_mon.config.manpage` makes docs/man/gpu_mon.conf.5; run it after changing a key."""
    assert PAGE.read_text() == manpage.render()


def test_the_man_page_names_every_section_and_key():
    if shutil.which("man") is None:
        pytest.fail("man(1) is missing: apt-get install man-db (as .ci/run does)")
    shown = subprocess.run(
        ["man", "-l", str(PAGE)],
        capture_output=True,
        text=True,
        env={"MANWIDTH": "200", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "MAN_KEEP_FORMATTING": ""},
        check=True,
    ).stdout
    text = re.sub(r".\x08", "", shown)
    for spec in schema.SECTIONS:
        part = text[text.index(spec.header) :]
        for key in spec.keys:
            assert re.search(rf"^ +{key.name}( =|$| \(required\)| )", part, re.M), f"{spec.header} {key.name}"


def test_no_file_of_the_config_is_the_largest_in_the_tree():
    def lines(path: Path) -> int:
        return len(path.read_text().splitlines())

    ours = {p: lines(p) for p in (ROOT / "gpu_mon" / "config").glob("*.py")}
    others = [lines(p) for p in (ROOT / "gpu_mon").rglob("*.py") if p not in ours]
    assert max(ours.values()) <= 400 and max(ours.values()) < max(others)
