"""No import cycle between the modules of `realm_jax`: every `import` / `from ... import` (at
module level or inside a function) is an edge, and the graph must have no strongly connected
component of more than one module, nor a module importing itself."""

import ast
import os

PACKAGE = "realm_jax"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)


def module_names() -> dict[str, str]:
  """{dotted module name: file path} for every .py under realm_jax/."""
  names = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        names[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return names


def imported(path: str, module: str, known: set[str]) -> set[str]:
  """The realm_jax modules `path` imports (`from pkg import mod` counts as pkg.mod)."""
  tree = ast.parse(open(path).read(), path)
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      out.add(base)
      out.update(f"{base}.{a.name}" for a in node.names)
  return {name for name in out if name in known and name != PACKAGE}


def import_graph() -> dict[str, set[str]]:
  names = module_names()
  return {m: imported(p, m, set(names)) for m, p in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module, and self-imports (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
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
      if len(component) > 1 or v in graph[v]:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_cycle_finder_finds_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
  assert sorted(cycles(graph)) == [["a", "b", "c"], ["e"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_the_package():
  graph = import_graph()
  assert "realm_jax.train.run" in graph and "realm_jax.workdir" in graph
  assert "realm_jax.workdir" in graph["realm_jax.train.run"]
  assert "realm_jax.train.candidates" in graph["realm_jax.train.loop"]


def test_no_import_cycle_in_realm_jax():
  graph = import_graph()
  found = cycles(graph)
  assert not found, "import cycles: " + "; ".join(
      " <-> ".join(c) + " (" + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a])
                                         if b in c) + ")" for c in found)


LAYERS = {   # package -> the packages it must never import (the floors above it)
    "realm_jax.config": ("realm_jax.runtime", "realm_jax.retrieval", "realm_jax.train"),
    "realm_jax.runtime": ("realm_jax.retrieval", "realm_jax.train"),
    "realm_jax.retrieval": ("realm_jax.train",),
    # the HF checkpoint-format readers runtime/initialization.py starts a part from: below
    # runtime/ (interop's converters and the NER tagger above them may import anything)
    **{f"realm_jax.interop.{reader}": ("realm_jax.runtime", "realm_jax.retrieval",
                                      "realm_jax.train")
       for reader in ("hf_bert", "hf_realm_weights", "torch_pickle")},
    # the commands and demo drivers above the library (a run evaluates through train/'s own
    # evaluators; realm-eval and realm-predict import them)
    "realm_jax.train": ("realm_jax.openqa_eval", "realm_jax.predict", "realm_jax.stages",
                        "realm_jax.demo", "realm_jax.demo_squad", "realm_jax.demo_real"),
}


def test_the_layers_import_only_downwards():
  """config/ below runtime/ below retrieval/ below train/ below the commands and demo drivers:
  what both the trainer and the index builder need lives below both."""
  graph = import_graph()
  upward = [f"{module} -> {target}" for module, targets in sorted(graph.items())
            for package, above in LAYERS.items() if module.startswith(package + ".")
            or module == package for target in sorted(targets)
            if any(target == a or target.startswith(a + ".") for a in above)]
  assert not upward, "imports that run up a layer: " + "; ".join(upward)
