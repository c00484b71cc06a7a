"""bridge is the lower layer: jaxmodels imports it, never the other way round."""

import ast
import pathlib
import subprocess
import sys

BRIDGE = pathlib.Path(__file__).resolve().parents[2] / "bridge"
SOURCES = sorted(BRIDGE.glob("*.py"))
MODULES = ["bridge" if path.stem == "__init__" else f"bridge.{path.stem}" for path in SOURCES]


def test_importing_every_bridge_module_loads_no_jaxmodels():
    # A fresh interpreter: what this test process has imported already must not count.
    script = ("import importlib, sys\n"
              f"for name in {MODULES!r}:\n"
              "    importlib.import_module(name)\n"
              "print(sorted(name for name in sys.modules if name.partition('.')[0] == 'jaxmodels'))")
    result = subprocess.run([sys.executable, "-c", script], cwd=BRIDGE.parent, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def imported_names(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        return [node.module]
    return []


def test_no_bridge_function_imports_jaxmodels():
    """The imports inside functions, which importing the modules does not run."""
    offenders = [f"{path.name}:{node.lineno} imports {name}"
                 for path in SOURCES
                 for node in ast.walk(ast.parse(path.read_text()))
                 for name in imported_names(node) if name.partition(".")[0] == "jaxmodels"]
    assert offenders == []
