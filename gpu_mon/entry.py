"""The `gpu-mon` executable (and `python -m gpu_mon`): the commands a person or a shell waits on answered
with the fewest imports, everything else by gpu_mon.cli.

`_job-ids` (a TAB's completion: gpu_mon/jobids.py) and a common `submit` (commands/quicksubmit.py) are
answered before the whole CLI is imported (150-250 ms); the quick submit hands anything it is not sure of
to the CLI before sending anything. Nothing here is imported by gpu_mon.cli or by the modules it calls.
"""

from __future__ import annotations

import os
import sys


def console_main() -> None:
    """Answer `gpu-mon ARGS...` and exit."""
    argv = sys.argv[1:]
    if argv[:1] == ["_job-ids"]:
        from gpu_mon import jobids

        sys.stdout.write("".join(f"{i}\n" for i in jobids.job_ids(argv[1:])))
        sys.stdout.flush()
        os._exit(0)
    if "submit" in argv:
        from gpu_mon.commands import quicksubmit

        code = quicksubmit.submit(argv)
        if code is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    from gpu_mon.cli import console_main as cli_main

    cli_main()
