"""`make setup` installs with uv from the sources pip's configuration names (deploy/install_packages.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "install_packages.py"
spec = importlib.util.spec_from_file_location("install_packages", SCRIPT)
install_packages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_packages)

# `pip config list` as this machine prints it: files' sections, then pip's environment variables.
LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/other.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/srv/ignored-wheels'
install.index-url='https://mirror.example/simple'
global.index-url='https://ignored.example/simple'
"""


def test_environment_beats_the_install_section_beats_global():
    settings = install_packages.pip_settings(LISTING)
    assert settings["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over pip.conf's
    assert settings["cert"] == "/etc/ssl/certs/ca-certificates.crt"
    assert settings["index-url"] == "https://mirror.example/simple"  # [install] over [global]
    assert settings["constraint"] == "/etc/xdg/pip/constraints.txt"


def test_uv_gets_every_source_and_pips_choice_among_indexes():
    arguments = install_packages.uv_source_arguments(install_packages.pip_settings(LISTING))
    pairs = list(zip(arguments[::2], arguments[1::2], strict=True))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")
    assert ("--find-links", "/opt/wheels") in pairs
    assert ("--find-links", "/srv/ignored-wheels") not in pairs
    assert ("--extra-index-url", "file:///opt/pypi/simple") in pairs
    assert ("--extra-index-url", "file:///opt/pypi-more/simple") in pairs
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert ("--index-url", "https://mirror.example/simple") in pairs
    assert "--no-index" not in arguments


def test_no_index_and_an_empty_configuration():
    assert install_packages.uv_source_arguments({}) == ["--index-strategy", "unsafe-best-match"]
    settings = install_packages.pip_settings("global.no-index='true'\n")
    assert "--no-index" in install_packages.uv_source_arguments(settings)
