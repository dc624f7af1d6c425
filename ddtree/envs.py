"""Boolean environment switches (DDTREE_FORCE_REFERENCE_*, TRITON_INTERPRET, ...), read one way everywhere."""

from __future__ import annotations

import os


def env_flag(name: str) -> bool:
    """Unset, empty, 0, false, no and off (any case) mean off; any other value means on."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")
