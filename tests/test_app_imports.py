"""app/'s layout, checked from the source: no module reaches itself through its imports (those inside
functions included: a lazy import hides a cycle, it doesn't remove it), and the gateway sees the rest of
app/ only through the modules every layer shares (settings, db, tables, errors, data_dir)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

APP = ROOT / "app"
# What app.gateway may import from outside itself: the layer below every package of app/.
# app.data_dir: the data folder's permissions, stdlib only (the gateway makes it private before SQLite opens it)
FOUNDATION = {"app.errors", "app.db", "app.tables", "app.settings", "app.data_dir"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in APP.rglob("*.py")}


def _type_checking_only(node: ast.If) -> bool:
    return (
        isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def imports_of(module: str) -> set[str]:
    """The app modules `module` imports, at the top or inside functions; not those under `if TYPE_CHECKING`
    (annotations only, never run)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    found.add(submodule if submodule in MODULES else node.module)
            elif isinstance(node, ast.If) and _type_checking_only(node):
                visit(node.orelse)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(tree.body)
    return {name for name in found if name in MODULES and name != module}


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> the modules it imports) as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" after
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in graph[module]:
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := walk(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := walk(module)):
            return cycle
    return None


def test_the_checker_sees_the_imports_and_finds_a_cycle():
    assert "app.gateway.contract" in imports_of("app.main")
    assert "app.gateway.wiring" in imports_of("app.cli.serve")  # imported inside serve()
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_no_module_of_app_imports_itself_through_a_cycle():
    cycle = find_cycle({module: sorted(imports_of(module)) for module in MODULES})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_gateway_imports_nothing_of_app_but_the_foundation():
    leaks = {
        module: sorted(
            target for target in imports_of(module) if not target.startswith("app.gateway") and target not in FOUNDATION
        )
        for module in MODULES
        if module.startswith("app.gateway")
    }
    assert {module: targets for module, targets in leaks.items() if targets} == {}


def test_a_server_imports_the_single_sign_on_libraries_only_when_it_signs_in():
    """Authlib and joserfc (with the cryptography they pull in) stay out of a server that isn't configured for
    single sign-on: at the top of app/dashboard/sso.py they held 9-14 MiB of every server's memory."""
    import subprocess
    import sys

    check = (
        "import sys; import app.main, app.cli.main, app.scaleout.replica_app, app.dashboard.sso_routes; "
        "print(' '.join(m for m in ('authlib', 'joserfc') if m in sys.modules) or 'none'); "
        "from app.dashboard.sso import OidcClient; from app.dashboard.sso_config import SsoConfig; "
        "OidcClient(SsoConfig('https://id.example', 'tokenmill', 's', {}, None, {})); "
        "print('authlib' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, cwd=ROOT)
    assert run.stdout.split() == ["none", "True"]
