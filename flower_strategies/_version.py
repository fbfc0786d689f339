"""The package version: ``[project] version`` of ``pyproject.toml``, its one source.

Flower reads that literal when it builds or runs the app (a FAB must declare ``[project] version``), so it cannot
be a dynamic field; this module reads it back:

1. from the ``pyproject.toml`` next to the package when it is fedadapt's (a source checkout, an editable install,
   an unpacked FAB: the file describes exactly the code being imported, even when an editable install's metadata
   is older);
2. else from the installed distribution's metadata (a wheel: built from that same field);
3. else ``"0+unknown"``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DISTRIBUTION = "fedadapt"
UNKNOWN = "0+unknown"


def _from_pyproject(path: Path) -> str | None:
    try:
        import tomllib
    except ImportError:  # Python 3.10: use the metadata
        return None
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, ValueError):
        return None
    version = project.get("version")
    return str(version) if project.get("name") == DISTRIBUTION and version else None


def read_version(pyproject: Path = Path(__file__).resolve().parent.parent / "pyproject.toml") -> str:
    version = _from_pyproject(pyproject)
    if version is not None:
        return version
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN


__version__ = read_version()
