"""The admin's limits on `gpu-mon occupy on`: the [occupy] section of the system config.

The system config is always /etc/gpu_mon.conf, whatever --config, --sim or the environment say, so a user
cannot name another one. (GPU_MON_SYSTEM_CONFIG names another file only for root, who may edit the real
one anyway: it lets an admin or the test suite try limits out.) No file, or no [occupy] in it: no limits.
A file that cannot be read, is not root's alone, or has any error: `on` is refused (fail closed).

The limits bind `gpu-mon occupy`; they are not a sandbox: a user who may run programs may still run one
that uses a GPU.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import sys
from dataclasses import dataclass
from typing import Callable, FrozenSet, List, Optional

from gpu_mon import config
from gpu_mon.api import occupiers
from gpu_mon.commands import base
from gpu_mon.commands.occupy_spec import OccupySpec

SYSTEM_CONFIG = config.DEFAULT_PATH
SYSTEM_CONFIG_ENV = "GPU_MON_SYSTEM_CONFIG"


def system_config_path() -> str:
    """SYSTEM_CONFIG, or $GPU_MON_SYSTEM_CONFIG when running as root."""
    if os.getuid() == 0 and os.geteuid() == 0:
        return os.environ.get(SYSTEM_CONFIG_ENV) or SYSTEM_CONFIG
    return SYSTEM_CONFIG


def load_limits(path: str) -> Optional[config.OccupySection]:
    """The [occupy] section, None when there is none; CliError (exit 1) when the file cannot be trusted."""
    if not os.path.lexists(path):
        return None
    try:
        return config.load(path, trusted_uid=0).occupy
    except config.ConfigError as err:
        more = f" (and {len(err.errors) - 1} more: gpu-mon check)" if len(err.errors) > 1 else ""
        raise base.CliError(
            f"occupy: refused: the admin's limits cannot be read: {err.errors[0]}{more}", base.EXIT_FAILURE
        ) from None


# ------------------------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Who:
    """The user asking: name, uid and the groups the group database gives them."""

    name: str
    uid: int
    groups: FrozenSet[str]


@dataclass(frozen=True)
class Refusal:
    """Which limit refuses: `users` (not on the allowed lists) or `max_gpus_per_user`."""

    limit: str
    asked: Optional[int] = None  # GPUs this occupier would take (None: unknown, no GPU could be read)
    elsewhere: int = 0  # GPUs the user's other occupiers take
    allowed: int = 0


def refusal(
    limits: config.OccupySection, who: Who, asked: Optional[int], elsewhere: int
) -> Optional[Refusal]:
    """Pure: why `on` is refused, or None. Root is always on the allowed lists."""
    listed = who.name in limits.users or bool(who.groups & set(limits.groups))
    if (limits.users or limits.groups) and who.uid != 0 and not listed:
        return Refusal("users")
    most = limits.max_gpus_per_user
    if most is not None and (asked is None or asked + elsewhere > most):
        return Refusal("max_gpus_per_user", asked, elsewhere, most)
    return None


def words(r: Refusal, who: Who, path: str) -> str:
    """One line for a refusal."""
    if r.limit == "users":
        return f"occupy: refused: {who.name} may not occupy GPUs here ([occupy] users and groups in {path})"
    limit = f"[occupy] max_gpus_per_user = {r.allowed} in {path}"
    if r.asked is None:
        return f"occupy: refused: no GPU could be read to count them; name at most {r.allowed} ({limit})"
    also = f" and your other occupiers take {r.elsewhere}" if r.elsewhere else ""
    return f"occupy: refused: this takes {r.asked} GPU(s){also}, more than {limit} (name fewer with --gpus)"


# ------------------------------------------------------------------------------------------------ `on`


def current_user() -> Who:
    """The real user, with their groups from the group database (not ones a process picked up)."""
    uid = os.getuid()
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return Who(str(uid), uid, frozenset())
    gids = os.getgrouplist(pw.pw_name, pw.pw_gid)
    names = set()
    for gid in gids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return Who(pw.pw_name, uid, frozenset(names))


def gpus_elsewhere(uid: int) -> int:
    """GPUs this user's live occupiers (under another state directory) take; CliError (exit 1) when the
    registry that lists them cannot be trusted (fail closed)."""
    problem = occupiers.registry_problem(occupiers.registry_dir())
    if problem:
        raise base.CliError(
            f"occupy: refused: [occupy] max_gpus_per_user cannot count your other occupiers: {problem}",
            base.EXIT_FAILURE,
        )
    return sum(int(r.get("gpu_count") or 0) for r in occupiers.list_occupiers() if r["uid"] == uid)


def apply(spec: OccupySpec, asked: Optional[int]) -> OccupySpec:
    """The spec as the limits allow it: CliError (exit 1) when refused; --yield forced when required."""
    path = system_config_path()
    limits = load_limits(path)
    if limits is None:
        return spec
    who = current_user()
    found = refusal(limits, who, asked, gpus_elsewhere(who.uid) if limits.max_gpus_per_user else 0)
    if found is not None:
        raise base.CliError(words(found, who, path), base.EXIT_FAILURE)
    if limits.require_yield and not spec.polite:
        print(
            f"gpu-mon occupy: --yield is required here ([occupy] require_yield in {path}): "
            "this occupier gives the GPUs back whenever anyone else uses one",
            file=sys.stderr,
        )
    return dataclasses.replace(
        spec,
        polite=spec.polite or limits.require_yield,
        max_hold_hours=limits.max_hold_hours,
        limits_from=path,
    )


# ---------------------------------------------------------------------------------------------- `serve`


def serve_listeners(spec: OccupySpec, end: Callable[[], None], started: float) -> List[object]:
    """The occupier's public record, and its hold limit when the admin set one."""
    from gpu_mon.commands.occupy_holdlimit import HoldLimit
    from gpu_mon.outputs.occupiers import PublicRecord

    base_doc = {
        "start_ticks": _start_ticks(),
        "started_wall": round(started, 3),
        "gpus_asked": [str(g) for g in spec.gpus],
        "gpu_count": len({str(g).lower() for g in spec.gpus}) or None,  # None: every GPU, counted later
        "polite": spec.polite,
        "runs": spec.what,
        "max_hold_hours": spec.max_hold_hours,
    }
    found: List[object] = [PublicRecord(occupiers.registry_dir(), base_doc, spec.polite)]
    if spec.max_hold_hours:
        found.append(HoldLimit(spec.max_hold_hours, spec.limits_from, end))
    return found


def _start_ticks() -> int:
    from gpu_mon.api.procfs import read_stat

    st = read_stat(os.getpid())
    return st.start_ticks if st else 0
