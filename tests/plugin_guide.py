"""The plugin guide's complete packages, as docs/writing-a-plugin.md holds them: read by the test that installs
and runs them (``test_plugin_docs``) and by the one that runs every other block of the docs
(``test_docs_examples``), which leaves these to the first."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "writing-a-plugin.md"
FILE_BLOCK = re.compile(r"<!-- file: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)
#: distribution -> package of the four packages the guide holds
PACKAGES = {
    "memmode-qint8": "memmode_qint8",
    "memmode-keepfirst": "memmode_keepfirst",
    "memmode-zram": "memmode_zram",
    "memmode-nf4": "memmode_nf4",
}


def files_from_the_guide() -> dict[str, str]:
    return {m["path"]: m["body"] for m in FILE_BLOCK.finditer(GUIDE.read_text())}
