"""Writes ``docs/api.md``, the API reference, from the docstrings: every public name of ``scsgd_jax``,
``scsgd_jax.sketch`` and ``scsgd_jax.contrib`` with its signature and the first paragraph of its docstring.

  python -m tests.api_doc

``tests/library/test_api.py`` fails when the committed file differs from what this writes.
"""

import inspect
import os
import re

import scsgd_jax

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "api.md")
TIERS = (
    ("scsgd_jax", "The optimizers, their transformations and state types, the capture helpers, diagnostics."),
    ("scsgd_jax.sketch", "The pure sketching functions and the correlation statistics."),
    ("scsgd_jax.contrib", "Experimental variants: two-sided conditioning, grafting."),
)


def _entry(module_name: str, name: str, obj) -> str:
  if inspect.ismodule(obj):
    return ""
  if callable(obj):
    try:
      signature = re.sub(r"ForwardRef\('([^']*)'\)", r"\1", str(inspect.signature(obj)))
      head = f"`{module_name}.{name}{re.sub(r' at 0x[0-9a-f]+', '', signature)}`"
    except (TypeError, ValueError):
      head = f"`{module_name}.{name}`"
    doc = inspect.getdoc(obj) or ""
  else:  # a constant
    head, doc = f"`{module_name}.{name} = {obj!r}`", ""
  first = " ".join(doc.split("\n\n")[0].split())
  return f"### {name}\n\n{head}\n\n{first}\n" if first else f"### {name}\n\n{head}\n"


def render() -> str:
  parts = ["# API reference\n", "Written by `python -m tests.api_doc` from the docstrings (signature and first "
           "paragraph of every public name); the full docstrings are in the code, the concepts in "
           "[how it works](how_it_works.md).\n"]
  for module_name, what in TIERS:
    module = scsgd_jax if module_name == "scsgd_jax" else getattr(scsgd_jax, module_name.split(".")[1])
    parts.append(f"## `{module_name}`\n\n{what}\n")
    parts.extend(e for e in (_entry(module_name, n, getattr(module, n)) for n in module.__all__) if e)
  return "\n".join(parts)


def main():
  with open(PATH, "w") as f:
    f.write(render())
  print(PATH)


if __name__ == "__main__":
  main()
