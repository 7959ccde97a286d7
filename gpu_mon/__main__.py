"""`python -m gpu_mon` is `gpu-mon`."""

from gpu_mon.jobids import console_main

console_main()
