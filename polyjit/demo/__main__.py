"""``python -m polyjit.demo [options]``: the same as ``polyjit demo``."""

import sys

from polyjit.demo import run

sys.exit(run())
