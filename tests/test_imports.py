"""No import circles in the package: read from the source (every `import` / `from ... import`, at module
level or inside a function), so a lazy import cannot hide one. The one kind allowed is a lazy
registry (ALLOWED), a circle closed only by a function-local import, with the reason."""
import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")

# Circles allowed, each closed by a function-local import: {modules: why}.
ALLOWED = {
    # ModelConfig asks the family registry (random defaults, LoRA targets, parameter counts); the
    # families build ModelConfigs. models/config.py imports the registry inside `_families()`.
    frozenset({"rljax.models.config", "rljax.models.families", "rljax.models.families.base",
               "rljax.models.layers"}): "the model-family registry",
}


def _modules() -> dict[str, str]:
  """{"rljax.config.schema": path, "rljax.config": path of its __init__, ...}"""
  out = {}
  for directory, _, files in os.walk(os.path.join(ROOT, "rljax")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(directory, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


def import_graph(module_level_only: bool = False) -> dict[str, set[str]]:
  """module -> the rljax modules it imports anywhere in its source (or at module level only). `from
  pkg import sub` counts as importing `pkg.sub` (and `pkg` only when a name that is not a
  submodule is imported from it)."""
  mods = _modules()

  def owner(name: str) -> str:
    while name not in mods and "." in name:
      name = name.rsplit(".", 1)[0]
    return name if name in mods else ""

  graph = {}
  for name, path in mods.items():
    deps = set()
    tree = ast.parse(open(path, encoding="utf-8").read())
    nodes = [n for top in tree.body if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             for n in ast.walk(top)] if module_level_only else ast.walk(tree)
    for node in nodes:
      if isinstance(node, ast.Import):
        deps.update(owner(a.name) for a in node.names if a.name.startswith("rljax"))
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rljax"):
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
        deps.update(subs)
        if len(subs) < len(node.names):
          deps.add(owner(node.module))
    graph[name] = deps - {"", name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_package_has_no_import_circles():
  graph = import_graph()
  assert {"rljax.config.schema", "rljax.trainer.setup", "rljax.plan.programs"} <= set(graph)
  assert "rljax.trainer.setup" in graph["rljax.plan.programs"]   # the graph sees real edges
  assert [c for c in cycles(graph) if frozenset(c) not in ALLOWED] == []
  # The allowed ones are lazy: no circle among the imports that run when a module loads.
  assert cycles(import_graph(module_level_only=True)) == []


def test_a_circle_is_found():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
