"""`python -m gpu_mon` is `gpu-mon`."""

from gpu_mon.entry import console_main

console_main()
