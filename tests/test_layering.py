"""The layers import downwards only: services never import the API or the dev tooling, the caller
type neither; models import no service; the Triton client no launcher; what runs inside Triton
nothing of ours."""

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


# The wings of embeddings/services/ and the wings each may import (services/__init__.py).
WINGS_ALLOWED = {
    "accounts": set(),
    "quotas": set(),
    "inference": {"quotas"},
    "jobs": {"accounts", "quotas", "inference"},
    "openai_api": {"quotas", "inference", "jobs"},
    "operations": {"accounts", "quotas", "inference", "jobs"},
}


def wing_imports(wing: str) -> dict[str, set[str]]:
    """The other wings each module of `wing` imports."""
    found = {}
    for path in sorted((PACKAGE_DIR / "services" / wing).rglob("*.py")):
        others = {
            module.split(".")[2]
            for module in imported_modules(path)
            if module.startswith("embeddings.services.") and len(module.split(".")) > 3
        } & set(WINGS_ALLOWED)
        found[str(path.relative_to(PACKAGE_DIR))] = others - {wing}
    return found


def test_the_wings_are_the_services():
    """Every module of services/ lives in a wing but the shared page helper."""
    loose = {path.name for path in (PACKAGE_DIR / "services").glob("*.py")} - {"__init__.py", "pages.py"}
    assert loose == set()
    assert {path.name for path in (PACKAGE_DIR / "services").iterdir() if path.is_dir()} >= set(WINGS_ALLOWED)


@pytest.mark.parametrize("wing", sorted(WINGS_ALLOWED))
def test_each_wing_imports_only_the_wings_it_may(wing):
    found = wing_imports(wing)
    assert found  # the walk looked at the wing's modules
    assert {
        path: others - WINGS_ALLOWED[wing] for path, others in found.items() if others - WINGS_ALLOWED[wing]
    } == {}


def test_the_job_engine_knows_kinds_not_batches():
    """The Batch API is a job kind named in settings: the jobs wing never names it, nor its model."""
    for path in sorted((PACKAGE_DIR / "services" / "jobs").rglob("*.py")):
        assert "embeddings.services.openai_api" not in {m.rsplit(".", 1)[0] for m in imported_modules(path)}
        assert "Batch" not in {
            m.rsplit(".", 1)[-1] for m in imported_modules(path) if m.startswith("embeddings.models")
        }


def test_the_worker_imports_no_api():
    """Celery tasks reach request contracts and the error table below the API, not through it."""
    assert not {m for m in imported_modules(PACKAGE_DIR / "tasks.py") if m.startswith("embeddings.api")}


def test_contracts_and_errors_sit_below_services_and_the_api():
    for package in ("contracts", "errors"):
        for forbidden in ("embeddings.services", "embeddings.api"):
            assert imports_from(PACKAGE_DIR / package, forbidden) == {}
    # The root of every exception imports nothing: the Triton client and the tokenizer subclass it.
    assert imported_modules(PACKAGE_DIR / "errors" / "__init__.py") == set()


def api_import_chain(module: str, graph: dict[str, set[str]], seen: tuple[str, ...] = ()) -> list[str]:
    """The longest chain of api modules `module` imports through (itself first)."""
    assert module not in seen, f"an import cycle in embeddings/api: {[*seen, module]}"
    chains = [api_import_chain(other, graph, (*seen, module)) for other in graph[module]]
    return [module, *max(chains, key=len, default=[])]


def test_the_api_is_at_most_four_import_levels_deep():
    """Views import shared helpers (docs, forms, authentication, base), never one another."""
    api_dir = PACKAGE_DIR / "api"
    graph = {
        path.stem: {m.split(".")[2] for m in imported_modules(path) if m.startswith("embeddings.api.")}
        - {path.stem}
        for path in api_dir.glob("*.py")
    }
    deepest = max((api_import_chain(module, graph) for module in graph), key=len)
    assert len(graph) > 10 and len(deepest) <= 4, deepest


def test_no_module_imports_another_modules_private_names():
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("embeddings"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                if private:
                    found[str(path.relative_to(PACKAGE_DIR))] = private
    assert found == {}


def test_coroutines_take_the_plain_name_and_blocking_twins_sync():
    """`quota_reserve` is a coroutine, `quota_reserve_sync` its blocking twin: no coroutine is named
    `..._async` (or `..._sync`). Functions that return a client are named for it (redis_async())."""
    suffixed = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.AsyncFunctionDef) and node.name.endswith(("_async", "_sync")):
                suffixed.append(f"{path.relative_to(PACKAGE_DIR)}: {node.name}")
    assert suffixed == []


def test_models_import_no_service():
    """The vocabulary models use (result dtypes, callers) sits below them, not in a wing."""
    modules = imported_modules(PACKAGE_DIR / "models.py")
    assert not {m for m in modules if m.startswith(("embeddings.services", "embeddings.api"))}


def test_the_triton_client_is_only_the_client():
    """The launcher is tooling, the backends run inside Triton: the runtime client imports neither."""
    assert imports_from(PACKAGE_DIR / "triton", "embeddings.tooling") == {}
    assert imports_from(PACKAGE_DIR / "triton", "embeddings.in_triton") == {}
    assert imports_from(PACKAGE_DIR / "triton", "django") == {}


def test_what_runs_inside_triton_imports_nothing_of_ours():
    """Triton's stubs load the backends by path, without the project on sys.path."""
    backends = PACKAGE_DIR / "in_triton" / "backends"
    assert sorted(backends.rglob("model.py"))  # the walk below looks at something
    assert imports_from(backends, "embeddings") == {}


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
