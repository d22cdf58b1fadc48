"""The import map: no cycles among the project's modules (imports inside functions count too), nothing imports
the command line, and the inference core imports none of the tooling (bench, eval, profile, the shared CLI
helpers and results files)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "models", "ops", "configs")
TOOLING = ("tailorkv.cli", "tailorkv.engine.bench", "tailorkv.engine.evaluation", "tailorkv.engine.profiling",
           "tailorkv.engine.ui", "tailorkv.engine.options", "tailorkv.engine.repl", "tailorkv.engine.results")


def project_modules() -> dict[str, str]:
    """module name -> file path, for every .py file of the package tailorkv (the repository root)."""
    out = {"tailorkv": os.path.join(ROOT, "__init__.py"), "tailorkv.cli": os.path.join(ROOT, "cli.py")}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    out["tailorkv." + rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def imports_of(path: str, modules: dict[str, str]) -> set[str]:
    """The project modules that `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n:
                found.add(n)
    return found


def graph():
    modules = project_modules()
    return {m: imports_of(p, modules) - {m} for m, p in modules.items()}


def test_no_import_cycles():
    deps = graph()
    # a package's __init__ importing nothing keeps parents out of the picture; find any cycle by DFS
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(deps[m]):
            if d in deps[m] and state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(deps):
        if m not in state:
            visit(m)


def test_nothing_imports_the_cli():
    bad = [m for m, ds in graph().items() if "tailorkv.cli" in ds]
    assert bad == [], f"these modules import cli.py: {bad}"


def test_core_imports_no_tooling():
    def tooling(m):
        return any(m == t or m.startswith(t + ".") for t in TOOLING)
    bad = {m: sorted(d for d in ds if tooling(d)) for m, ds in graph().items() if not tooling(m)}
    bad = {m: ds for m, ds in bad.items() if ds}
    assert bad == {}, f"inference core modules import tooling: {bad}"


def test_core_files_are_small():
    core = [p for m, p in project_modules().items()
            if m.startswith(("tailorkv.engine", "tailorkv.models", "tailorkv.ops"))
            and not any(m == t or m.startswith(t + ".") for t in TOOLING)]
    long = {os.path.relpath(p, ROOT): n for p in core if (n := sum(1 for _ in open(p))) > 320}
    assert long == {}, f"core files over ~300 lines: {long}"
