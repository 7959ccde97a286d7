"""gpu_mon's library: GPUs (NVML or simulated), who holds them, terminal users, one look at the host.

Usable from Python by a plain user: no daemon, no root, no logging set-up, no signal handlers. It imports
nothing from the daemon (gpu_mon.engine), the command line or the outputs; tests/test_layers.py checks.
"""
