"""A checkpoint's ``config.json`` with attribute access, independent of transformers.

Model plugins read fields from it; nested dicts (``text_config``,
``rope_parameters``) become :class:`HFConfig` too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class HFConfig:
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    @classmethod
    def from_file(cls, path: str | Path) -> HFConfig:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self._wrap(self._data[key])
        except KeyError:
            raise AttributeError(f"config.json has no field {key!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        value = self._data.get(key, default)
        return default if value is None else self._wrap(value)

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    @staticmethod
    def _wrap(value: Any) -> Any:
        return HFConfig(value) if isinstance(value, dict) else value

    def __repr__(self) -> str:
        return f"HFConfig({self._data!r})"
