"""Starting a job: its command as the leader runs it (as its user, through a small shell wrapper that
enters its directory and opens its output as the user), or, where systemd runs the machine, the
`systemd-run` that starts that as a transient unit of its own."""

from __future__ import annotations

import logging
import os
import pwd
from typing import List, Optional, Tuple

from gpu_mon.api.text import sanitize
from gpu_mon.engine.workloads import transient
from gpu_mon.engine.workloads.supervisor import Launch, StartError, unit_launch
from gpu_mon.engine.workloads.transient import Unit
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.requests import groups_of, output_of

log = logging.getLogger("gpu_mon")

# Run as the user: go to the submit directory, make the default output directory (0700), open the output
# file with the user's own rights (never root's), then become the command. $1 directory, $2 output file,
# $3 the directory to make ("-" with --output), the rest the command. What fails is said on stderr, which the
# leader reads (`note_stderr`) as the job's reason: `cannot open /x/3.log: Permission denied` (the shell's
# own message ends with the error, after its last `: `).
_WRAPPER = (
    'fail() { printf "%s: %s\\n" "$1" "${2##*: }" >&2; exit 126; }; '
    'cd -- "$1" 2>/dev/null || fail "cannot enter $1" "$([ -d "$1" ] && echo Permission denied '
    '|| echo No such directory)"; '
    '[ "$3" = - ] || e=$( (umask 077; mkdir -p -- "$3") 2>&1) || fail "cannot make $3" "$e"; '
    'e=$( (umask 077; : >>"$2") 2>&1) || { [ -d "${2%/*}/" ] || e="No such file or directory"; '
    'fail "cannot open $2" "$e"; }; '
    'exec >>"$2" 2>&1 || exit 126; shift 3; exec "$@"'
)


def direct(job: Job, gpus: Tuple[str, ...]) -> Launch:
    """The job's command as the leader runs it: as the user, through the wrapper."""
    env = dict(job.env)
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(gpus),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "GPU_MON_JOB_ID": str(job.id),
            "GPU_MON_JOB_REF": J.ref(job),  # (as every listing names it: `17`, an element `17_5`)
            "GPU_MON_RESTART_COUNT": str(job.restarts),
        }
    )
    if job.array_id:
        env.update({"GPU_MON_ARRAY_ID": str(job.array_id), "GPU_MON_ARRAY_INDEX": str(job.array_index)})
    switch = os.geteuid() == 0
    if not switch and job.uid != os.geteuid():
        try:
            name = pwd.getpwuid(job.uid).pw_name
        except KeyError:
            name = str(job.uid)
        raise StartError(f"cannot run as {name}: gpu-mon is not running as root")
    output = output_of(job)
    make = "-" if job.output else os.path.dirname(output)  # (--output's directory is the user's to make)
    return Launch(
        argv=("/bin/sh", "-c", _WRAPPER, "gpu-mon-job", job.cwd, output, make, *job.command),
        dir="/",
        env=env,
        uid=job.uid,
        gid=job.gid,
        groups=groups_of(job.uid, job.gid),
        switch_user=switch,
        note_stderr=True,
    )


def as_unit(job: Job, direct: Launch, run_dir: str, devices: Optional[List[str]], guard: float) -> Launch:
    """`systemd-run` starting the job (`direct`) as a transient unit of its own (workloads/transient.py):
    its environment in a root-only file in `run_dir`, its end recorded by the unit, `devices` the only
    ones it may open (None: not confined). StartError when its environment cannot be written."""
    end_file = direct.end_file or ""
    name = transient.unit_name(job.id, job.restarts)
    env, dropped = transient.environment(direct.env)
    if dropped:
        names = sanitize(", ".join(sorted(dropped)), limit=200)
        log.info("queue: job %s: not passed to its unit (systemd refuses them): %s", J.ref(job), names)
    what = f"gpu-mon job {J.ref(job)} of {job.user} (restart {job.restarts})"
    try:
        env_path = transient.env_file(run_dir, name, env)
    except OSError as err:  # (never on systemd-run's command line: anyone may read that)
        raise StartError(f"cannot write its environment for systemd: {err.strerror or err}") from None
    argv = transient.command(
        *(name, what, direct.argv, env_path, job.uid, job.gid, job.stop_signal, job.grace, end_file),
        main_only=job.stop_main_only,
        stderr=transient.stderr_file(run_dir, name),
        devices=devices,
    )
    return unit_launch(argv, Unit(name, transient.unit_group(name)), end_file, guard)
