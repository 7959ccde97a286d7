"""The built-in stressor's engine, behind `gpu-mon stress` (commands/stress.py) and `occupy`'s workloads.

plan (options and how memory is split, pure), signals (a stop in every phase), torchdev (the one module that
imports torch, lazily), work (the compute buffers and kernels), fill (holding memory), loop (the compute duty
cycle and its reports), release (giving memory back on a stop), report (the log lines), stressor (one run).
"""
