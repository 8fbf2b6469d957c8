"""No module imports from a layer above its own (the order is in gpipe_fast/__init__.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpipe_fast

PACKAGE = Path(gpipe_fast.__file__).parent

# Lowest first, as gpipe_fast/__init__.py lists them; a module belongs to the layer of
# its longest matching prefix.
LAYERS: list[tuple[str, ...]] = [
    ("gpipe_fast._C", "gpipe_fast.arguments"),
    ("gpipe_fast.nn", "gpipe_fast.device", "gpipe_fast.skip"),
    ("gpipe_fast.capture",),
    ("gpipe_fast.schedule",),
    ("gpipe_fast.transport",),
    ("gpipe_fast.distributed",),
    ("gpipe_fast.runtime",),
    ("gpipe_fast.balancing",),
    ("gpipe_fast.api",),
    ("gpipe_fast.planning",),
    ("gpipe_fast", "gpipe_fast.balance"),  # the facade: the package's own names
    ("gpipe_fast.demo",),
    ("gpipe_fast.__main__",),
]


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank >= 0, f"{module} is in no layer"
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """Every gpipe_fast module `path` imports, at any depth (in functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import module` imports the module
                candidate = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(
                    ".py"
                ).exists() or (PACKAGE.parent / candidate.replace(".", "/")).is_dir()
                found.add(candidate if is_module or alias.name == "_C" else node.module)
    return {name for name in found if name == "gpipe_fast" or name.startswith("gpipe_fast.")}


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for target in sorted(imported(path)):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} (layer {layer_of(module)}) imports {target} "
                              f"(layer {layer_of(target)})")  # fmt: skip
    assert not upward, "\n".join(upward)


def test_every_module_opens_with_a_one_line_docstring() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        assert docstring, f"{path} has no docstring"
        lines = docstring.splitlines()
        assert len(lines) == 1 or not lines[1].strip(), f"{path}: its summary is not one line"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "fake.py"
    source.write_text(
        "from gpipe_fast.runtime.step import Step\ndef later():\n    from gpipe_fast import api\n"
    )
    assert imported(source) == {"gpipe_fast.runtime.step", "gpipe_fast.api"}
    assert layer_of("gpipe_fast.runtime.step") > layer_of("gpipe_fast.transport.protocol")
    assert layer_of("gpipe_fast.planning.plan") > layer_of("gpipe_fast.api.gpipe")
    assert layer_of("gpipe_fast.balancing.balance") < layer_of("gpipe_fast.api.gpipe")
