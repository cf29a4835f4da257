"""The package reads top-down: cli -> (demo, serve) -> (bench, banks, load, driver) -> train -> decode -> checkpoint
I/O -> models -> (attention, pages) -> shared basics -> kernels. Every import of a project module, at module level or
inside a function, goes to the importer's layer or one below it (parsed with ``ast``, nothing imported)."""
import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (module or package prefix, layer); the longest matching prefix decides. Higher layers may import lower ones.
LAYERS = (
    ("pallas_kernels", 0),
    ("jetspec_jax.errors", 1), ("jetspec_jax.config", 1), ("jetspec_jax.sharding", 1), ("jetspec_jax.cache", 1),
    ("jetspec_jax.stages", 1), ("jetspec_jax.files", 1), ("jetspec_jax.hlo_cost", 1), ("jetspec_jax.memory_maps", 1),
    ("jetspec_jax.attention", 2), ("jetspec_jax.pages", 2),
    ("jetspec_jax.models", 3),
    ("jetspec_jax.checkpoint", 4), ("jetspec_jax.convert", 4), ("jetspec_jax.tokenizer", 4),
    ("jetspec_jax.distributed", 4),
    ("jetspec_jax.decode", 5),
    ("jetspec_jax.train", 6), ("jetspec_jax.configs", 6),
    ("jetspec_jax.bench", 7), ("jetspec_jax.banks", 7), ("jetspec_jax.trace_summary", 7), ("jetspec_jax.load", 7), ("jetspec_jax.driver", 7),
    ("jetspec_jax.demo", 8), ("jetspec_jax.serve", 8),
    ("jetspec_jax.cli", 9),
    ("jetspec_jax", 9),            # the package's own __init__
)


def layer(module: str) -> int | None:
  matches = [(len(prefix), level) for prefix, level in LAYERS if module == prefix or module.startswith(prefix + ".")]
  return max(matches)[1] if matches else None


def project_modules():
  for package in ("jetspec_jax", "pallas_kernels"):
    for folder, _, files in os.walk(os.path.join(REPO, package)):
      for name in sorted(files):
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
          yield module, path


MODULES = dict(project_modules())


def imported(path: str):
  """Every project module the file's import statements name (``from a import b``: a.b when that is a
  module, else a)."""
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names]
    else:
      names = []
    yield from (n for n in names if layer(n) is not None)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_only(module):
  own = layer(module)
  assert own is not None, f"{module} has no layer in LAYERS"
  up = sorted({(name, layer(name)) for name in imported(MODULES[module]) if layer(name) > own})
  assert not up, f"{module} (layer {own}) imports from above: {up}"


def test_the_kernels_import_nothing_from_jetspec_jax():
  for module, path in MODULES.items():
    if module.startswith("pallas_kernels"):
      assert not [n for n in imported(path) if n.split(".")[0] == "jetspec_jax"], module
