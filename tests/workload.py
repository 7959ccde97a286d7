"""A stand-in workload for the tests: reports who it is, holds device files, has children.

Every event is one JSON line appended to --report (small O_APPEND writes do not interleave).
"""

import argparse
import json
import os
import signal
import sys
import time


def report(path, event, **fields):
    """Append one event line."""
    if not path:
        return
    fields.update(event=event, pid=os.getpid())
    line = (json.dumps(fields) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--report")
    p.add_argument("--hold", action="append", default=[], help="device file to open and keep open")
    p.add_argument("--children", type=int, default=0, help="children that also hold the devices")
    p.add_argument("--escape", action="store_true", help="children leave our session (setsid)")
    p.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (tests escalation)")
    p.add_argument("--exit-after", type=float, help="exit by itself after this many seconds")
    p.add_argument("--code", type=int, default=0, help="exit code for --exit-after")
    p.add_argument("--say", default="", help="print this line (backslash escapes decoded) once started")
    a = p.parse_args()
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: (report(a.report, "term"), os._exit(0)))
    held = [open(path, "rb") for path in a.hold]  # noqa: SIM115 - held open on purpose
    for _ in range(a.children):
        if os.fork() == 0:
            if a.escape:
                os.setsid()
            report(a.report, "child", ppid=os.getppid(), sid=os.getsid(0), pgid=os.getpgid(0))
            while True:
                time.sleep(3600)
    env = {
        k: os.environ.get(k)
        for k in (
            "CUDA_VISIBLE_DEVICES",
            "CUDA_DEVICE_ORDER",
            "PATH",
            "HOME",
            "USER",
            "LOGNAME",
            "NOTIFY_SOCKET",
            "WATCHDOG_USEC",
            "GPU_MON_PROCESS",
            "SECRET_OF_THE_DAEMON",
            "EXTRA",
        )
    }
    report(
        a.report,
        "start",
        ppid=os.getppid(),
        sid=os.getsid(0),
        pgid=os.getpgid(0),
        uid=os.getuid(),
        euid=os.geteuid(),
        gid=os.getgid(),
        groups=sorted(os.getgroups()),
        cwd=os.getcwd(),
        env=env,
        stdin=os.readlink("/proc/self/fd/0"),
        held=len(held),
    )
    if a.say:
        print(a.say.encode().decode("unicode_escape"), flush=True)  # \x1b etc. spelled out in the config
    if a.exit_after is not None:
        time.sleep(a.exit_after)
        report(a.report, "exit", code=a.code)
        sys.exit(a.code)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
