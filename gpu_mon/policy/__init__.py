"""Pure policy: what the daemon should do, decided from what it saw. Needs only gpu_mon.api and
gpu_mon.config; never does I/O and never imports the engine, the queue, outputs or the CLI."""
