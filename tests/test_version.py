"""One version: pyproject's ``[project] version`` = ``flower_strategies.__version__`` = CITATION.cff's; the
project files (LICENSE, CITATION.cff, CHANGELOG.md) agree with pyproject."""

from __future__ import annotations

import datetime
import re
import tomllib
from importlib import metadata
from pathlib import Path

import yaml

import flower_strategies
from flower_strategies import _version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pyproject_version_dunder_version_and_citation_agree():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert flower_strategies.__version__ == PROJECT["version"] == str(citation["version"])
    assert re.search(rf"^## \[{re.escape(PROJECT['version'])}\]", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_citation_cff_has_the_required_fields_of_cff_1_2_0():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0"
    assert citation["message"] and citation["title"] and citation["type"] == "software"
    assert citation["authors"] == [{"name": "fedadapt contributors"}]
    assert citation["license"] == PROJECT["license"]["text"] == "Apache-2.0"
    datetime.date.fromisoformat(str(citation["date-released"]))


def test_license_is_the_apache_2_0_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 11000


def test_version_fallbacks(tmp_path, monkeypatch):
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "someone-else"\nversion = "9.9"\n')
    monkeypatch.setattr(_version.metadata, "version", lambda name: "1.2.3")
    assert _version.read_version(other) == "1.2.3"  # not fedadapt's pyproject: the installed metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "version", not_installed)
    assert _version.read_version(tmp_path / "missing.toml") == _version.UNKNOWN
    other.write_text('[project]\nname = "fedadapt"\nversion = "2.0.0"\n')
    assert _version.read_version(other) == "2.0.0"
