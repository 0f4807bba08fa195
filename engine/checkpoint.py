"""A checkpoint directory's config.json as read (no torch: the daemon reads
it before any worker starts)."""

from __future__ import annotations

import json
import os


def raw_config(path: str) -> dict:
    """config.json of checkpoint `path` as read; ValueError (or OSError) when it is not a JSON object."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}/config.json: not a JSON object")
    return raw


def model_type(path: str) -> str | None:
    """config.json's model_type (None where it cannot be read: the loader then says what is wrong)."""
    try:
        kind = raw_config(path).get("model_type")
    except (OSError, ValueError):
        return None
    return kind if isinstance(kind, str) else None
