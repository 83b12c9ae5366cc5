"""``python -m memmode_core`` is the ``memmode`` command."""

import sys

from memmode_core.cli import main

sys.exit(main())
