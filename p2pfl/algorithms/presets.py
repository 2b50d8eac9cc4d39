"""Named hyperparameter presets (``algorithm.preset`` in a config); config keys override them."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {}
