"""Read the JSON metadata files of model folders, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_json_object"]


def read_json_object(path: str | Path) -> dict:
    """The JSON object held by ``path`` (``config.json``, ``tokenizer_config.json``, ...).

    Raises:
      ValueError: the file is not UTF-8, not JSON, or holds something other than an object;
        the message names the file.
    """
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(value).__name__}")
    return value
