"""gpu_mon: run work on idle NVIDIA GPUs and yield the instant anyone else needs them."""

__version__ = "0.1.0"
