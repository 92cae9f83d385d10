"""The experiments' house, read statically: no import cycle (imports inside functions count), small modules, and every
entry point and config file the user-facing pages name exists, no function over 60 lines (a move that forgets a page fails here)."""

import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the pages that tell a user which command to run today (the results folders' own READMEs record the commands their
# runs ran with, experiments/results/README.md today's command for each)
PAGES = ("README.md", "experiments/README.md", "experiments/results/README.md", "docs/results.md")
MAX_LINES = 350


def _modules() -> dict[str, str]:
  """``{dotted name: path}`` of every module under experiments/."""
  found = {}
  for path in glob.glob(os.path.join(ROOT, "experiments", "**", "*.py"), recursive=True):
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    found[name.removesuffix(".__init__")] = path
  return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
  """The experiments modules ``path`` imports, at module level or inside a function."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
  return {m for m in out if m in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
  """One import cycle of ``graph`` (``[a, b, ..., a]``), or ``[]``."""
  state: dict[str, int] = {}

  def visit(node, path):
    state[node] = 1
    for dep in sorted(graph[node]):
      if state.get(dep) == 1:
        return path[path.index(dep):] + [dep]
      if dep not in state and (found := visit(dep, path + [dep])):
        return found
    state[node] = 2
    return []

  for node in sorted(graph):
    if node not in state and (found := visit(node, [node])):
      return found
  return []


def test_cycle_finder_finds_a_cycle_and_only_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_experiments_have_no_import_cycle():
  modules = _modules()
  graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
  assert len(graph) > 40 and any(graph.values())
  assert _cycle(graph) == []


def test_no_experiments_module_is_over_350_lines():
  long = {n: c for n, p in _modules().items() if (c := sum(1 for _ in open(p))) > MAX_LINES}
  assert not long, long


def test_no_experiments_function_is_over_60_lines():
  """A training loop or a report written as one function is split into named steps (docstrings aside)."""
  from tests.library.test_api import _code_lines

  long = [(n, f.name, _code_lines(f)) for n, p in _modules().items() for f in ast.walk(ast.parse(open(p).read()))
          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(f) > 60]
  assert not long, long


def _named(pattern: str) -> set[str]:
  text = "".join(open(os.path.join(ROOT, page)).read() for page in PAGES)
  return set(re.findall(pattern, text))


def test_every_entry_point_the_pages_name_is_a_runnable_module():
  names = _named(r"python -m (experiments(?:\.[a-z_0-9]+)+)")
  assert {"experiments.run.main", "experiments.paper.compare", "experiments.head_to_head.benchmark"} <= names
  for name in sorted(names):
    base = os.path.join(ROOT, *name.split("."))
    if os.path.isdir(base):
      assert os.path.exists(os.path.join(base, "__main__.py")), name
    else:
      assert 'if __name__ == "__main__":' in open(base + ".py").read(), name


CONFIG_PATH = r"configs/[A-Za-z0-9_/<>$]+\.py"


def test_the_pages_name_entry_points_and_configs():
  assert len(_named(CONFIG_PATH)) > 10 and "configs/mnist.py" in _named(CONFIG_PATH)


@pytest.mark.parametrize("path", sorted(_named(CONFIG_PATH)))
def test_every_config_the_pages_name_exists(path):
  """A placeholder (``<task>``, ``$task``) stands for every config of its folder (its helpers aside)."""
  matches = glob.glob(os.path.join(ROOT, re.sub(r"<[a-z]+>|\$[a-z]+", "*", path)))
  assert matches, path
  if matches != [os.path.join(ROOT, path)]:
    for match in matches:
      assert os.path.basename(match) in ("__init__.py", "common.py") or "def get_config(" in open(match).read(), match
