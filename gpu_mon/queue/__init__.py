"""The queue: users' own jobs on GPUs nobody else uses (`gpu-mon submit`). See docs/ARCHITECTURE.md."""
