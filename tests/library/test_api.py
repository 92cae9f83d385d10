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


def test_the_top_level_holds_at_most_29_names_and_no_internals():
  # 25 after the face was made plain, state_shardings (what every user sharding the state calls),
  # refresh_conditioners (what every training loop with Refresh(apart=True) calls), plans (the one way to read
  # the plans from any state the transforms sit in, which the README uses) and sow_rows (what a model with raw
  # parameters calls to have them conditioned)
  assert len(scsgd_jax.__all__) <= 29, scsgd_jax.__all__
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


# the most parameters each public optimizer and transformation takes: one signature per thing, the options grouped
# in objects (optax's adamw takes 8, scale_by_adam 6)
PARAMETERS = {
    "scsgd": 11,
    "scale_by_sketched_conditioning": 8,
    "scsgd_eigen": 18,
    "scsgd_eigen_muon": 18,  # scsgd_eigen's basis and sides too
    "scale_by_eigenbasis_adam": 17,
    "contrib.scsgd_two_sided": 14,
    "contrib.scale_by_output_conditioning": 9,
}


@pytest.mark.parametrize("name,most", sorted(PARAMETERS.items()))
def test_each_alias_takes_its_own_parameters_and_no_catch_all(name, most):
  import inspect

  fn = scsgd_jax
  for part in name.split("."):
    fn = getattr(fn, part)
  params = inspect.signature(fn).parameters.values()
  assert len(params) <= most, [p.name for p in params]
  assert not [p.name for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)], name


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
