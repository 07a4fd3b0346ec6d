"""The packages' shape, read from their import statements: Ray stays behind the cluster port, and no import
circles (issue: one port between admission and the cluster)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("weights_tool", "actors", "serve_app")
# The only modules under serve_app/ that may import Ray: its implementation of the port, and the app builder
# that chooses it (and binds Serve's deployment and metrics).
RAY_ALLOWED = ("serve_app/ray_cluster/", "serve_app/app.py")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module an import statement in `path` names (functions' own imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_module_of_serve_app_but_the_ray_cluster_and_the_app_builder_imports_ray():
    offenders = []
    for path in _modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("serve_app/") and not rel.startswith(RAY_ALLOWED):
            if any(i == "ray" or i.startswith("ray.") for i in _imports(path)):
                offenders.append(rel)
    assert not offenders, offenders


def test_admission_relay_and_rows_reach_the_cluster_only_through_the_port():
    modules = _modules()
    for name in ("serve_app.admission", "serve_app.relay", "serve_app.rows"):
        imported = _imports(modules[name])
        assert not {i for i in imported if i.startswith(("serve_app.ray_cluster", "serve_app.local_cluster"))}, name


def test_no_import_circles_between_the_projects_modules():
    modules = _modules()
    graph = {name: {i for i in _imports(path) if i in modules and i != name} for name, path in modules.items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        seen[name] = 1
        for dep in sorted(graph[name]):
            if seen.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep] if dep in path else [name, dep])
            elif dep not in seen:
                visit(dep, [*path, dep])
        seen[name] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])
    assert not circles, circles


def _loaded(imports: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter holds after `import <imports>`."""
    code = f"import sys, {imports}; print(sorted(m for m in {watched!r} if m in sys.modules))"
    return ast.literal_eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_a_requests_checks_before_any_compute_import_neither_ray_nor_torch():
    """Parsing, the chat template and the context window: the ingress's checks, with no engine behind them."""
    assert _loaded("serve_app.api, serve_app.openai_api, serve_app.prompt, actors.chat", ("ray", "torch", "numpy")) == []


def test_the_ingress_and_the_request_actors_class_import_no_torch():
    """The ingress holds tokenizers and figures, never weights: its replica, and the request actor class it hands
    to Ray, start without torch or the engine (each replica would otherwise pay for them at every start)."""
    assert _loaded("serve_app.app, actors.request_actor", ("torch", "actors.engine", "actors.model")) == []
