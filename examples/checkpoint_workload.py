"""A workload that saves a checkpoint when gpu-mon stops it, and resumes from it when started again.

Run it with `stop_signal = SIGUSR1` in its [process-*] section. On SIGUSR1 it finishes the step it is in,
writes its checkpoint (to a temporary file, then renamed over the old one: a stop in the middle never leaves a
half-written checkpoint) and exits 0. A SIGTERM (an urgent stop, after the short grace) ends it at once with
the last complete checkpoint in place.

    python3 checkpoint_workload.py CHECKPOINT [--save-seconds S]

--save-seconds makes saving slow, as saving a large model is (the test of this example uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

stop_requested = False


def on_stop_signal(_signum: int, _frame: object) -> None:
    global stop_requested
    stop_requested = True  # act on it between steps, never inside a signal handler


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"step": 0}


def save(path: str, state: dict, seconds: float) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f'{{"step": {state["step"]:d}, ')
        f.flush()
        time.sleep(seconds)  # a large model takes a while to write
        f.write('"complete": true}\n')
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: the old checkpoint stays whole until the new one is


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--save-seconds", type=float, default=0.0)
    args = parser.parse_args()
    signal.signal(signal.SIGUSR1, on_stop_signal)
    state = load(args.checkpoint)
    print(f"resuming at step {state['step']}", flush=True)
    while not stop_requested:
        time.sleep(0.05)  # one training step
        state["step"] += 1
    save(args.checkpoint, state, args.save_seconds)
    print(f"checkpoint saved at step {state['step']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
