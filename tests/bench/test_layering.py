"""The benches sit above the product: no product module imports ``bench`` (``python -m
kvservice.bench`` imports it only when run), and kvservice imports no Django."""

from __future__ import annotations

import ast
from pathlib import Path

from bench.data import REPO_ROOT


def _imported_packages(path: Path) -> set[str]:
    """Top-level packages ``path`` imports, leaving out its ``if __name__ == "__main__"``."""
    tree = ast.parse(path.read_text())
    main_blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    ]
    skipped = {id(inner) for block in main_blocks for inner in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def _modules(*packages: str) -> list[Path]:
    return [path for package in packages for path in (REPO_ROOT / package).rglob("*.py")]


def test_no_product_module_imports_the_benches():
    importers = [
        p
        for p in _modules("kvservice", "webapp", "worker", "deploy")
        if "bench" in _imported_packages(p)
    ]
    assert importers == []


def test_kvservice_imports_no_django():
    assert [p for p in _modules("kvservice") if "django" in _imported_packages(p)] == []


def test_the_entry_point_imports_the_bench_only_when_run():
    entry = REPO_ROOT / "kvservice" / "bench.py"
    assert "bench" in _imported_packages(REPO_ROOT / "bench" / "long_context.py")
    assert "bench" not in _imported_packages(entry)
    assert "from bench.prefill import main" in entry.read_text()


def test_kvservice_imports_neither_deploy_nor_webapp():
    """The engine and the worker stand alone: the dev stack and the web app sit above them."""
    importers = [p for p in _modules("kvservice") if {"deploy", "webapp"} & _imported_packages(p)]
    assert importers == []
