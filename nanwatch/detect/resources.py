"""Where the shipped rule packs (``parsers/``) and known causes (``alerts/``) live.

An installed wheel carries them as ``nanwatch/_data/<name>``; a checkout or an editable install
finds them beside the package, at the top of the repository. Both are looked up the same way.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

_PKG = Path(__file__).resolve().parent.parent  # the nanwatch package


def data_dir(name: str) -> Path:
    """The directory of a shipped data folder: ``parsers`` or ``alerts``."""
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise ConfigError(
        f"the shipped {name}/ folder is missing (looked in {_PKG / '_data' / name} and "
        f"{_PKG.parent / name}); reinstall nanwatch"
    )
