"""The library's face: a tiered API (at most 25 names at the top, sorted ``__all__`` in every tier), an optax core
that imports without Flax, experiments that use only the public API, and an API reference that is not stale."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

import scsgd_jax
from tests import api_doc

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", [scsgd_jax, scsgd_jax.sketch, scsgd_jax.contrib], ids=lambda m: m.__name__)
def test_every_tier_has_a_sorted_all_whose_names_resolve(module):
  assert module.__all__ == sorted(module.__all__)
  for name in module.__all__:
    assert getattr(module, name) is not None, name
  assert not {n for n in vars(module) if not n.startswith("_") and n not in module.__all__} - {"importlib"}


def test_the_top_level_holds_at_most_31_names_and_no_internals():
  # 25 after the face was made plain, state_shardings (what every user sharding the state calls),
  # refresh_conditioners (what every training loop with Refresh(apart=True) calls), plans (the one way to read
  # the plans from any state the transforms sit in, which the README uses) and sow_rows (what a model with raw
  # parameters calls to have them conditioned), muon_without_momentum (the public transform scsgd_eigen_muon chains),
  # clip_by_relative_norm (the step bound scsgd chains)
  assert len(scsgd_jax.__all__) <= 31, scsgd_jax.__all__
  internals = {"KernelPlan", "LayerInput", "layer_rows", "GraftState", "EmaState", "BoundTerms", "LINEN_COLLECTION",
               "without_momentum", "eigenbasis", "scsgd_two_sided"}
  assert not internals & set(scsgd_jax.__all__)


def test_the_optax_core_imports_and_runs_without_flax():
  """With Flax unimportable, the optimizers build, init and update (only the capture helpers need Flax)."""
  code = ("import sys; sys.modules['flax'] = None\n"
          "import jax.numpy as jnp, scsgd_jax\n"
          "params = {'dense': {'kernel': jnp.zeros((8, 3))}}\n"
          "for tx in (scsgd_jax.scsgd(0.1), scsgd_jax.scsgd_eigen(1e-3), scsgd_jax.scsgd_eigen_muon(0.02)):\n"
          "  state = tx.init(params)\n"
          "  tx.update(params, state, params, layer_inputs={'dense/kernel': jnp.ones((4, 8))})\n"
          "assert 'flax.nnx' not in sys.modules\n"
          "try:\n"
          "  scsgd_jax.capture_nnx\n"
          "except ImportError:\n"
          "  print('capture needs flax')\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "capture needs flax" in out.stdout


def test_experiments_use_only_the_public_api():
  offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "experiments").rglob("*.py")
               if re.search(r"scsgd_jax\._src|from scsgd_jax import _src", p.read_text())]
  assert not offenders, offenders


def test_the_api_reference_is_written_from_the_docstrings():
  """docs/api.md is what ``python -m tests.api_doc`` writes now: regenerate it after changing a public signature or
  the first paragraph of a public docstring."""
  with open(api_doc.PATH) as f:
    assert f.read() == api_doc.render(), "docs/api.md is stale: run python -m tests.api_doc"
  assert os.path.basename(api_doc.PATH) == "api.md"


# the most parameters each public optimizer and transformation takes: the conditioning's settings one argument, a
# Conditioning (optax's adamw takes 9, scale_by_adam 6); none over 12
PARAMETERS = {
    "scsgd": 5,
    "scale_by_sketched_conditioning": 2,
    "scsgd_eigen": 11,
    "scsgd_eigen_muon": 11,  # scsgd_eigen's basis and sides too
    "scale_by_eigenbasis_adam": 10,
    "contrib.scsgd_two_sided": 7,
    "contrib.scale_by_output_conditioning": 4,
}


def _public(name):
  fn = scsgd_jax
  for part in name.split("."):
    fn = getattr(fn, part)
  return fn


@pytest.mark.parametrize("name,most", sorted(PARAMETERS.items()))
def test_each_alias_takes_the_conditioning_as_one_argument_and_no_catch_all(name, most):
  import dataclasses
  import inspect

  params = inspect.signature(_public(name)).parameters
  assert len(params) <= min(most, 12), list(params)
  assert not [p.name for p in params.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)], name
  assert isinstance(params["conditioning"].default, scsgd_jax.Conditioning), name
  fields = {f.name for f in dataclasses.fields(scsgd_jax.Conditioning)}
  assert not fields & set(params), (name, fields & set(params))


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_each_alias_and_transform_is_at_most_40_lines(name):
  """An alias is the composition its docstring shows, not a second implementation (docstring aside)."""
  import inspect
  import textwrap

  fn = inspect.unwrap(_public(name))
  node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
  assert _code_lines(node) <= 40, (name, _code_lines(node))


def test_no_signature_block_is_written_twice_in_the_library():
  """The conditioning's settings are fields of one object: no function of the library takes three or more of them
  as parameters of its own."""
  import dataclasses

  fields = {f.name for f in dataclasses.fields(scsgd_jax.Conditioning)}
  offenders = []
  for path in sorted((ROOT / "scsgd_jax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names = {a.arg for a in node.args.args + node.args.kwonlyargs}
        if len(names & fields) >= 3:
          offenders.append((path.name, node.name, sorted(names & fields)))
  assert not offenders, offenders


def test_the_core_never_imports_the_contrib_tier():
  """The experimental tier (the output side, the two-sided alias, grafting) sits in modules of its own; the core's
  modules import none of them (``scsgd_jax.contrib`` loads on first use)."""
  offenders = []
  for path in sorted((ROOT / "scsgd_jax").rglob("*.py")):
    if "contrib" in path.relative_to(ROOT / "scsgd_jax").parts or path.name == "contrib.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else [])
      offenders += [(path.name, n) for n in names if n.startswith(("scsgd_jax.contrib", "scsgd_jax._src.contrib"))]
  assert not offenders, offenders


def test_the_library_tests_import_nothing_from_the_experiments():
  """The library's tests build the options themselves: a library change is tested without the experiments."""
  offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "library").rglob("*.py")
               if re.search(r"^\s*(from|import) experiments\b", p.read_text(), re.M)]
  assert not offenders, offenders


def test_no_library_module_reads_its_own_arguments_by_introspection():
  """No ``locals()`` and no ``inspect.signature``: each signature is the one place its arguments are read."""
  offenders = [
      str(p.relative_to(ROOT))
      for p in (ROOT / "scsgd_jax").rglob("*.py")
      if re.search(r"\blocals\(\)|inspect\.signature", p.read_text())
  ]
  assert not offenders, offenders


def _code_lines(node) -> int:
  """A function's lines, its docstring left out."""
  body = node.body
  docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1
  return node.end_lineno - (body[1] if docstring else body[0]).lineno + 1


def test_library_modules_and_functions_stay_small():
  """No library module over 350 lines (the pure sketching functions excepted), no function over 60 (docstrings
  aside): a room with two jobs is split, not let grow."""
  big, long = [], []
  for path in sorted((ROOT / "scsgd_jax").rglob("*.py")):
    text = path.read_text()
    if text.count("\n") > 350 and path.name != "sketch.py":
      big.append((path.name, text.count("\n")))
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > 60:
        long.append((path.name, node.name, _code_lines(node)))
  assert not big and not long, (big, long)
