"""Slurm on this node: which processes belong to which job, which preemptible jobs must yield (pure), and
the calls that ask Slurm to act (`scontrol`, `scancel`). Library level: nothing of the daemon here."""
