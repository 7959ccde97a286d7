"""`python -m gpu_mon` is `gpu-mon`."""

from gpu_mon.cli import console_main

console_main()
