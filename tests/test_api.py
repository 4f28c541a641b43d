"""`plugserve.api`, the one import surface for plugin authors: every name it lists resolves, and the example
plugin imports nothing else of plugserve."""

import ast
import importlib
import warnings
from pathlib import Path

import plugserve.api as api

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "third_party_plugin"


def _plugserve_imports(path: Path) -> list[str]:
    """The plugserve modules a file imports (every `import` and `from ... import`, also inside functions)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return [name for name in found if name == "plugserve" or name.startswith("plugserve.")]


def test_every_name_in_all_resolves_without_a_deprecation_warning():
    assert api.__all__, "plugserve.api lists no names"
    assert len(set(api.__all__)) == len(api.__all__), "plugserve.api.__all__ lists a name twice"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no name comes through an old path
        importlib.reload(api)
        missing = [name for name in api.__all__ if getattr(api, name, None) is None]
    assert not missing, f"plugserve.api.__all__ names what it does not define: {missing}"


def test_the_backend_contracts_are_there():
    for name in ("AttentionBackend", "Fp8GemmBackend", "MoEBackend", "Availability", "ForwardBatch", "ForwardMode",
                 "AttnForwardMethod", "AttentionSpec", "hookimpl"):
        assert name in api.__all__, name


def test_the_example_plugin_imports_only_plugserve_api():
    sources = sorted(EXAMPLE.rglob("*.py"))
    assert sources, f"no example plugin under {EXAMPLE}"
    offenders = {str(path.relative_to(ROOT)): name for path in sources for name in _plugserve_imports(path)
                 if name != "plugserve.api"}
    assert not offenders, f"the example plugin imports plugserve outside plugserve.api: {offenders}"
    assert any(_plugserve_imports(path) for path in sources), "the example plugin does not import plugserve.api"


def test_the_readme_plugin_section_imports_only_plugserve_api():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Writing a backend plugin", 1)[1].split("\n## ", 1)[0]
    imports = [line.split()[1] for line in section.splitlines()
               if line.startswith(("from plugserve", "import plugserve"))]
    assert imports, "the README's plugin section imports nothing from plugserve"
    assert set(imports) == {"plugserve.api"}, f"the README's plugin section imports {imports}"
