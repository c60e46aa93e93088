"""`python -m loadgen ...`: the same as `kvpath loadgen ...`."""

import sys

from loadgen.cli import main

sys.exit(main())
