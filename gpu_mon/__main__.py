"""`python -m gpu_mon` is `gpu-mon`."""

import sys

from gpu_mon.cli import main

sys.exit(main())
