"""``python -m wb_kernels.bench ...``: the benchmark's command line (lesson 11); see ``--help``."""

import sys

from .cli import main

sys.exit(main())
