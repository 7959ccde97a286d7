"""The parts of bench/gpu_proof.py: the checks (checks.py), what their outputs say (figures.py, junit.py),
running each in a subprocess with a time budget (run.py), the GPU host (host.py) and the table (render.py)."""
