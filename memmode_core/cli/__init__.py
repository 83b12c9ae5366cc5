"""The ``memmode`` command: ``list``, ``run`` and ``plan``.

It uses memmode_core's public API (``import memmode_core as memmode``), except for reading which options the
installed plugins declare (:mod:`~memmode_core.cli.plugin_options`), which has no public form yet.

- :mod:`~memmode_core.cli.entry_point`: ``main``, the console script, and its exit statuses;
- :mod:`~memmode_core.cli.parser`: the subcommands, their flags and their help;
- :mod:`~memmode_core.cli.listing`: ``memmode list``;
- :mod:`~memmode_core.cli.run_command`: ``memmode run`` and its table; :mod:`~memmode_core.cli.runner` measures;
  :mod:`~memmode_core.cli.plotting` draws ``--plot``;
- :mod:`~memmode_core.cli.plan_command`: ``memmode plan``; :mod:`~memmode_core.cli.plan_table`: its table;
- :mod:`~memmode_core.cli.pipelines`: the pipeline ``run`` and ``plan`` work on, loaded and called;
  :mod:`~memmode_core.cli.demo_pipeline`: the built-in one;
- :mod:`~memmode_core.cli.plugin_options`: ``--option NAME=VALUE``, read and checked;
- :mod:`~memmode_core.cli.table`: aligned plain-text tables.

``main`` is here because the console script (``memmode = "memmode_core.cli:main"``) and
``python -m memmode_core.cli`` name it here.
"""

from memmode_core.cli.entry_point import main

__all__ = ["main"]
