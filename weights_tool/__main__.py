"""`python -m weights_tool ...`: the same commands as the `zq-weights` console script."""

import sys

from weights_tool.cli import main

sys.exit(main())
