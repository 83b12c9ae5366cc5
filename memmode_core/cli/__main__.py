"""``python -m memmode_core.cli`` is the ``memmode`` command."""

import sys

from memmode_core.cli import main

sys.exit(main())
