"""``python -m memmode_core`` is the ``memmode`` command."""

import sys

from .cli import main

sys.exit(main())
