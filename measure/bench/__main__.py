"""`python -m measure.bench`: see `measure.bench.cli`."""

import sys

from measure.bench.cli import main

sys.exit(main())
