"""`python -m cgym`: the same as the `cgym` console script."""

import sys

from cgym.cli import main

sys.exit(main())
