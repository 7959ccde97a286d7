"""The reference rendered from the parser: gpu-mon(1) and the bash, zsh and fish completions (`python -m
gpu_mon.docs_gen` writes them; `gpu-mon help` and `gpu-mon completion` print them).

`python -m gpu_mon.docs_gen` writes docs/man/gpu-mon.1 and docs/completion/ (`--check`: exit 1 and name
what is stale); `gpu-mon completion SHELL` prints a completion for pip users. tests/test_reference.py
fails when a committed file differs from what this generates.

Written here rather than taken from argparse-manpage and shtab: both are packaged by Debian (1.2.2 and
1.5.5 in bookworm) but produce different text from the PyPI releases, so a "committed equals generated"
test would depend on which one a machine has; neither knows our hidden commands, our signal-name and
job-id arguments, or the EXIT STATUS/SIGNALS/FILES/ENVIRONMENT text `gpu-mon help TOPIC` shares with the
page; and the package and its tests need nothing installed beyond the standard library. The whole is a
few hundred lines of plain string building; the output is checked by `man -l`/groff, bash, zsh and fish
in the tests.
"""
