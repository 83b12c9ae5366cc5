"""``python -m memmode_core.cli`` is the ``memmode`` command."""

import sys

from . import main

sys.exit(main())
