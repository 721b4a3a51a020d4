"""``python -m wb_kernels.bench ...``: the benchmark's command line (the dashboard lesson); see ``--help``."""

import sys

from .cli import main

sys.exit(main())
