"""A workload that tries to outlive its stop. Every process it makes carries the marker (argv[1]) in its
command line, so a test can find them all, whatever they did to their names, sessions and groups.

Modes (argv[2]):
  escape     double fork + setsid, and a grandchild that starts a child of its own; everyone ignores SIGTERM
             and renames itself; one child moves to its own process group; one stops itself (SIGSTOP)
  forkchain  a process that forks, calls setsid in the child and exits, over and over (new pid every time);
             each link appends a byte to the file argv[4], so a test can tell the chain lives (a look at
             /proc, listing then reading, misses a link that lives a millisecond when /proc is long)
argv[3]: seconds after which the main process exits by itself (0: never).
"""

import ctypes
import os
import signal
import sys
import time

libc = ctypes.CDLL(None)


def rename(name: bytes) -> None:
    libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


def sleeper(name: bytes) -> None:
    rename(name)
    while True:
        time.sleep(3600)


def escape() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:  # double fork into a new session
        os.setsid()
        if os.fork() == 0:
            if os.fork() == 0:
                sleeper(b"kworker/0:1")  # a grandchild's own child
            sleeper(b"sshd")
        os._exit(0)
    if os.fork() == 0:  # its own process group
        os.setpgid(0, 0)
        sleeper(b"bash")
    if os.fork() == 0:  # stopped: sees SIGTERM only with SIGCONT
        os.kill(os.getpid(), signal.SIGSTOP)
        sleeper(b"stopped")


def forkchain() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log = os.open(sys.argv[4], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if os.fork() == 0:
        while True:
            if os.fork() != 0:
                os._exit(0)
            os.setsid()
            os.write(log, b".")
            time.sleep(0.001)


def main() -> None:
    mode, exit_after = sys.argv[2], float(sys.argv[3])
    {"escape": escape, "forkchain": forkchain}[mode]()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("hostile ready", flush=True)
    if exit_after > 0:
        time.sleep(exit_after)
        os._exit(0)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
