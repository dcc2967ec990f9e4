"""``python -m polyjit``: the command line (polyjit.cli)."""

import sys

from polyjit.cli import main

sys.exit(main())
