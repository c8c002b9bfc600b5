"""`make setup`'s package install: uv installs into this virtualenv what pip would, from where pip would.

pip downloads and unpacks one package after another: on a fresh machine that was most of `make
setup` (about 1.5 min of a 2.3 min setup, the rest waiting on the network). uv fetches side by side
and installed the same versions of the same packages in about 20 s. uv does not read pip's
configuration, and a machine's pip may be told where packages lie that PyPI does not have as wanted
(this machine's and CI's keep PyTorch's CPU wheel on disk, `find-links`, and more indexes in
pip.conf, with a cap in a constraints file): without them uv would take PyTorch's CUDA build from
PyPI, gigabytes. So this hands uv the sources pip's configuration names, and pip's way of choosing
among indexes (the best version over all of them, not the first index that has the package).

Usage: `python deploy/install_packages.py [uv pip install arguments]`, with the virtualenv's Python.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

# pip's settings that say where packages come from, as uv names them. A value may list several,
# separated by whitespace (pip's own rule for these).
SOURCE_OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
# Which of pip's sections wins for `pip install`: its environment variables over the install
# command's section over the global one.
SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}
TRUE = {"1", "true", "yes", "on"}
CACHE = Path(__file__).resolve().parent.parent / ".run" / "uv-cache"


def pip_settings(listing: str) -> dict[str, str]:
    """pip's effective settings for `pip install`, from `pip config list`'s lines (`section.key='value'`)."""
    chosen: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, separator, quoted = line.partition("=")
        section, _, key = name.rpartition(".")
        rank = SECTION_RANK.get(section)
        if not separator or rank is None:
            continue
        value = ast.literal_eval(quoted)
        if key not in chosen or rank >= chosen[key][0]:
            chosen[key] = (rank, value)
    return {key: value for key, (_, value) in chosen.items()}


def uv_source_arguments(settings: dict[str, str]) -> list[str]:
    arguments = ["--index-strategy", "unsafe-best-match"]
    if settings.get("no-index", "").lower() in TRUE:
        arguments.append("--no-index")
    for key, option in SOURCE_OPTIONS.items():
        for value in settings.get(key, "").split():
            arguments += [option, value]
    return arguments


def main(arguments: list[str]) -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    uv = Path(sys.executable).with_name("uv")
    command = [str(uv), "pip", "install", "--quiet", "--python", sys.executable]
    settings = pip_settings(listing)
    command += uv_source_arguments(settings) + arguments
    # The cache lives in the checkout (.run/ is never committed): a fresh clone starts as a fresh
    # machine does, and uv links the venv's files from it rather than copying them.
    environment = {"UV_CACHE_DIR": str(CACHE), **os.environ}
    if settings.get("cert"):  # the CA bundle pip trusts (a proxy's own CA, say); uv's own roots otherwise
        environment.setdefault("SSL_CERT_FILE", settings["cert"])
    return subprocess.run(command, env=environment).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
