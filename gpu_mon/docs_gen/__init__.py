"""`python -m gpu_mon.docs_gen [--check]`: the generator of gpu-mon(1) and the completions, from the parser
(gpu_mon/cli.py) and the renderers of gpu_mon/reference/. It sits above the CLI, which nothing imports."""
