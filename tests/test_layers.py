"""No module imports from a higher layer or in a cycle (the layers: gpipe_fast/layers.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpipe_fast
from gpipe_fast.layers import LAYERS

PACKAGE = Path(gpipe_fast.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def full_name(name: str) -> str:
    """A layer's module name (under gpipe_fast; "__init__" is the package) in full."""
    return "gpipe_fast" if name == "__init__" else f"gpipe_fast.{name}"


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for index, layer in enumerate(LAYERS):
        for prefix in map(full_name, layer.modules):
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


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        graph[module] = imported(path) - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (the strongly
    connected components of more than one module), each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def table_rows() -> list[str]:
    """The rows of the layers' table as docs/architecture.md should write them."""

    def shown(name: str) -> str:
        if name == "_C":  # the native module: a built library, named as Python imports it
            return "`_C`"
        path = name.replace(".", "/")
        return f"`{path}/`" if (PACKAGE / path).is_dir() else f"`{path}.py`"

    return [f"| {', '.join(map(shown, layer.modules))} | {layer.holds} |" for layer in LAYERS]


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for target in sorted(imported(path)):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} (layer {layer_of(module)}) imports {target} "
                              f"(layer {layer_of(target)})")  # fmt: skip
    assert not upward, "\n".join(upward)


def test_no_modules_import_each_other_in_a_cycle() -> None:
    # A cycle within a layer passes the layer check, yet its modules cannot be read, tested or
    # moved one without the other (imports inside functions and for type checking count too).
    graph = import_graph()
    found = [
        f"{', '.join(group)} import each other: "
        + "; ".join(f"{a} imports {b}" for a in group for b in sorted(graph[a]) if b in group)
        for group in cycles(graph)
    ]
    assert not found, "\n".join(found)


def test_the_architecture_page_lists_the_layers() -> None:
    text = ARCHITECTURE.read_text()
    section = text.split("## The Python package, by layer", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # no header
    expected = table_rows()
    assert rows == expected, (
        "docs/architecture.md's table of layers is not gpipe_fast/layers.py's list; its rows "
        "should read:\n" + "\n".join(expected)
    )


# The cross-process side: only the composition root wires it in.
CROSS_PROCESS = ("gpipe_fast.distributed", "gpipe_fast.transport.processes")
COMPOSITION_ROOT = "gpipe_fast.runtime.pipeline"


def _is_in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_only_the_composition_root_wires_in_the_cross_process_side() -> None:
    # The one-process path (runtime/ but its composition root, and the layers below
    # distributed/) imports nothing of distributed/ or the transport across processes, even
    # inside a function or for type checking: what both sides use lives below runtime/.
    wired = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if not _is_in(module, ("gpipe_fast.runtime",)) or module == COMPOSITION_ROOT:
            continue
        wired += [
            f"{module} imports {t}" for t in sorted(imported(path)) if _is_in(t, CROSS_PROCESS)
        ]
    assert not wired, "\n".join(wired)


def test_the_pictures_have_a_room_of_their_own() -> None:
    # The timeline draws itself through pictures/, a layer below runtime/; nothing else in
    # the package draws (imports matplotlib, or a picture's modules).
    assert layer_of("gpipe_fast.pictures.svg") < layer_of("gpipe_fast.runtime.timeline")
    drawers = {"gpipe_fast.pictures", "gpipe_fast.runtime.timeline"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if _is_in(module, tuple(drawers)) or module.startswith("gpipe_fast.demo"):
            continue  # the demo only checks that matplotlib is there
        text = path.read_text()
        if "matplotlib" in text or any(_is_in(t, ("gpipe_fast.pictures",)) for t in imported(path)):
            found.append(module)
    assert not found, f"these draw outside pictures/: {found}"


def test_the_cross_process_rule_sees_a_hidden_import(tmp_path: Path) -> None:
    source = tmp_path / "fake.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from gpipe_fast.distributed.guard import Guard\n"
        "def later():\n    from gpipe_fast.transport.processes import registry\n"
    )
    assert {t for t in imported(source) if _is_in(t, CROSS_PROCESS)} == {
        "gpipe_fast.distributed.guard",
        "gpipe_fast.transport.processes.registry",
    }


def test_every_module_opens_with_a_one_line_docstring() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        assert docstring, f"{path} has no docstring"
        lines = docstring.splitlines()
        assert len(lines) == 1 or not lines[1].strip(), f"{path}: its summary is not one line"


# Small files with one purpose: a module past this has grown a second one (issue 40 split the
# facade, the trainer, the stage and the guard to get under it).
MOST_LINES = 450


def test_no_module_is_over_the_line_limit() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"over {MOST_LINES} lines: {long}"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "fake.py"
    source.write_text(
        "from gpipe_fast.runtime.step import Step\ndef later():\n    from gpipe_fast import api\n"
    )
    assert imported(source) == {"gpipe_fast.runtime.step", "gpipe_fast.api"}
    assert layer_of("gpipe_fast.runtime.step") > layer_of("gpipe_fast.transport.protocol")
    assert layer_of("gpipe_fast.planning.plan") > layer_of("gpipe_fast.api.gpipe")
    assert layer_of("gpipe_fast.balancing.balance") < layer_of("gpipe_fast.api.gpipe")


def test_the_checker_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"x": {"y"}, "y": {"x"}, "z": {"x"}}) == [["x", "y"]]
    assert cycles({"x": {"y"}, "y": set()}) == []
