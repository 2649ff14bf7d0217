"""``python -m tierstore``: the ``tierstore`` command."""

import sys

from tierstore.cli import main

sys.exit(main())
