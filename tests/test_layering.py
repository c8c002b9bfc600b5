"""The layers import downwards only: services never import the API or the dev tooling, the caller
type neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import embeddings

pytestmark = pytest.mark.unit

PACKAGE_DIR = Path(embeddings.__file__).parent


def imported_modules(path: Path, source: str | None = None) -> set[str]:
    """Every module `path` imports, anywhere in it (functions and TYPE_CHECKING blocks included),
    with relative imports resolved against its own package."""
    package = ["embeddings", *path.relative_to(PACKAGE_DIR).parent.parts]
    modules = set()
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, node.module] if node.module else base)
            modules.add(stem)
            # `from embeddings import api` imports the package embeddings.api.
            modules.update(f"{stem}.{alias.name}" for alias in node.names)
    return modules


def imports_from(directory: Path, forbidden: str) -> dict[str, list[str]]:
    found = {}
    for path in sorted(directory.rglob("*.py")):
        bad = sorted(m for m in imported_modules(path) if m == forbidden or m.startswith(forbidden + "."))
        if bad:
            found[str(path.relative_to(PACKAGE_DIR))] = bad
    return found


def test_services_never_import_the_api():
    assert imports_from(PACKAGE_DIR / "services", "embeddings.api") == {}


def test_services_never_import_the_tooling():
    """Process launchers and the torch export are for commands, tests and benchmarks only."""
    assert imports_from(PACKAGE_DIR / "services", "embeddings.tooling") == {}


def test_the_caller_type_sits_below_api_and_services():
    modules = imported_modules(PACKAGE_DIR / "callers.py")
    assert not {m for m in modules if m.startswith(("embeddings.api", "embeddings.services"))}


def test_the_walk_sees_every_kind_of_import():
    """The checks above would pass vacuously if the walk missed a form of import."""
    source = (
        "import embeddings.api.errors\n"
        "from embeddings.api import views\n"
        "from ..api.base import ApiView\n"
        "def late():\n    from embeddings import api\n"
    )
    assert {
        "embeddings.api.errors",
        "embeddings.api",
        "embeddings.api.views",
        "embeddings.api.base",
        "embeddings.api.base.ApiView",
    } <= imported_modules(PACKAGE_DIR / "services" / "example.py", source)
