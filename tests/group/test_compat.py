"""The module paths of before the layered layout (gradcoll._compat.MOVED): docs/api.md lists every one."""

from __future__ import annotations

import re
from pathlib import Path

from gradcoll._compat import MOVED

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_the_module_paths_table_lists_every_moved_module_and_where_it_lives() -> None:
    text = API.read_text(encoding="utf-8")
    table = dict(re.findall(r"^\| `(gradcoll[\w.]*)` \| `(gradcoll[\w.]*)` \|$", text, flags=re.M))
    assert table == MOVED, "docs/api.md 'Module paths' must list exactly gradcoll._compat.MOVED"

