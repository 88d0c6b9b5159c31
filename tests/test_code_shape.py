"""The code's shape. Dependencies point one way: the core (tree → flow → verify → build → models → target →
decode, with drafters, train and hf) → app (load_decoders) → the commands (commands, exits, serve, bench,
train.cli) → cli. Parsed from the source, so an upward import, a cycle or a long function fails here before it
confuses a reader."""

import ast
from pathlib import Path

import exitspec

ROOT = Path(exitspec.__file__).parent
# above app: what a command runs
COMMANDS = ("exitspec.commands", "exitspec.exits", "exitspec.serve", "exitspec.train.cli", "exitspec.bench")
CLI = ("exitspec.cli", "exitspec.options")  # the command line; `options` is its option groups


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(module imported, at function level?) for each exitspec import of a file, `if TYPE_CHECKING:` left out."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("exitspec"):
            names = [f"{node.module}.{a.name}" for a in node.names
                     if f"{node.module}.{a.name}" in known] or [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("exitspec")]
        else:
            continue
        found += [(name, id(node) not in top) for name in names if name in known]
    return found


def layer(module: str) -> int:
    """0 core, 1 app, 2 commands, 3 cli, 4 the `python -m` entry points."""
    if module.endswith("__main__"):
        return 4
    if module.startswith(CLI):
        return 3
    if module.startswith(COMMANDS):
        return 2
    return 1 if module == "exitspec.app" else 0


def graph() -> dict[str, set[str]]:
    """module → what it imports; importing a.b.c also runs the packages a.b above it, so those count too."""
    known = modules()
    edges = {}
    for module, path in known.items():
        targets = set()
        for name, _ in imports(path, set(known)):
            parts = name.split(".")
            targets |= {".".join(parts[:k]) for k in range(2, len(parts) + 1)} - {module}
        edges[module] = {t for t in targets if t in known and not module.startswith(t + ".")}
    return edges


def test_no_module_imports_a_layer_above_its_own():
    upward = [(m, t) for m, targets in graph().items() for t in targets if layer(t) > layer(m)]
    assert upward == [], upward


def test_no_import_cycle():
    edges, state, cycles = graph(), {}, []

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert cycles == [], cycles


def test_only_the_command_line_imports_inside_functions():
    """The cli defers torch until a command runs (its options are checked first); nothing else needs to, and
    a function-level import anywhere else would be hiding a cycle."""
    known = modules()
    late = [(m, name) for m, path in known.items() if m != "exitspec.cli"
            for name, in_function in imports(path, set(known)) if in_function]
    assert late == [], late


def test_no_function_is_longer_than_sixty_lines():
    """Long functions get split along their stages (trainer.train: start, step, log, finish)."""
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}")
    assert long == [], long
