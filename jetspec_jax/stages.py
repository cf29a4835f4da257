"""Cached pipeline stages whose cache key covers everything that determines their output.

A stage's key hashes four things: its settings, the keys of the stages it reads, the code that
produces it, and the versions of the libraries that change its numbers. Code is the syntax tree
(comments and docstrings dropped) of what the stage names (project modules, or single definitions
``module:name`` such as a builder function) plus all project code reached from there: the modules a
module imports, the definitions and modules a definition names, transitively. So an edit to code a
stage runs rebuilds exactly that stage, and the stages after it through their inputs. The marker of a finished stage records the parts of its
key, so a rebuild can say which of them changed.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from typing import Sequence

from jetspec_jax.files import write_json

PROJECT_PACKAGES = ("jetspec_jax", "pallas_kernels")


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _package_dir(package: str) -> str | None:
  spec = importlib.util.find_spec(package)
  return spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None


@functools.lru_cache(maxsize=None)
def _module_file(name: str) -> str | None:
  """The source file of project module ``name``, found without importing it (None when ``name`` is
  not a project module)."""
  top, *rest = name.split(".")
  root = _package_dir(top) if top in PROJECT_PACKAGES else None
  if root is None:
    return None
  if rest and not os.path.exists(os.path.join(root, rest[0])) and not os.path.isfile(os.path.join(root, rest[0] + ".py")):
    sub = _package_dir(f"{top}.{rest[0]}")        # a subpackage installed from elsewhere (configs/)
    if sub is not None:
      root, rest = sub, rest[1:]
  base = os.path.join(root, *rest)
  if rest and os.path.isfile(base + ".py"):
    return base + ".py"
  init = os.path.join(base, "__init__.py")
  return init if os.path.isfile(init) else None


def _strip_docstrings(tree: ast.AST) -> ast.AST:
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
        and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      node.body = body[1:] or [ast.Pass()]
  return tree


def _imported_modules(tree: ast.AST) -> dict[str, str]:
  """{local name: project module} for the imports anywhere in ``tree`` (``from a import b`` binds b
  to a.b when that is a module, else to a)."""
  bound = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        bound[a.asname or a.name] = sub if _module_file(sub) else node.module
  return {local: module for local, module in bound.items() if _module_file(module)}


def _parse(module: str) -> tuple[ast.Module, str]:
  """(syntax tree without docstrings, its digest) of project ``module``; callers must not edit the tree."""
  path = _module_file(module)
  if path is None:
    raise ValueError(f"{module} is not a project module")
  stat = os.stat(path)
  return _parse_file(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _parse_file(path: str, mtime_ns: int, size: int) -> tuple[ast.Module, str]:
  with open(path) as f:
    tree = _strip_docstrings(ast.parse(f.read()))
  return tree, hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def _names_used(node: ast.AST) -> set[str]:
  """Names that ``node`` reads, outside type annotations (which run no code)."""
  names = set()

  class Visitor(ast.NodeVisitor):
    def visit_Name(self, n):
      names.add(n.id)

    def visit_arg(self, n):
      pass

    def visit_AnnAssign(self, n):
      self.visit(n.target)
      if n.value is not None:
        self.visit(n.value)

  for child in ast.iter_child_nodes(node):
    if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and child is node.returns):
      Visitor().visit(child)
  return names


def _definition_parts(module: str, tree: ast.Module, name: str) -> tuple[str, list[str]]:
  """(digest of the top-level function, class or constant ``name`` of ``module``, the code it
  reaches: the module's other top-level functions, classes and constants it names, and project
  modules, named ``module:name`` or ``module``)."""
  defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
  defs.update({t.id: n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)})
  if name not in defs:
    raise ValueError(f"{module} has no top-level definition {name}")
  fn = defs[name]
  imported = _imported_modules(tree)
  used = _names_used(fn)
  reached = [f"{module}:{u}" for u in used if u in defs and u != name]
  reached += [imported[u] for u in used if u in imported]
  reached += list(_imported_modules(fn).values())
  return hashlib.sha256(ast.dump(fn).encode()).hexdigest(), reached


def code_version(names: Sequence[str]) -> str:
  """A digest of the code of project modules and definitions (``module:name``, for code that lives
  in a module the stage does not otherwise depend on) and of all project code they reach: every
  module a module imports, and the module functions and imported modules a function names."""
  seen, todo, parts = set(), list(names), {}
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    module, _, definition = name.partition(":")
    tree, digest = _parse(module)
    if definition:
      parts[name], reached = _definition_parts(module, tree, definition)
    else:
      parts[name], reached = digest, list(_imported_modules(tree).values())
    todo.extend(r for r in reached if r not in seen)
  return _digest(parts)


def library_versions(distributions: Sequence[str]) -> dict[str, str]:
  """{distribution: installed version} ("missing" for one that is not installed)."""
  versions = {}
  for name in distributions:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = "missing"
  return versions


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """What a stage's output depends on: ``fields`` of the settings, earlier stages (``inputs``), the
  project modules that build it, and the library distributions whose versions change its numbers."""
  name: str
  fields: tuple[str, ...]
  inputs: tuple[str, ...]
  modules: tuple[str, ...]
  libraries: tuple[str, ...]


def stage_key_parts(specs: Sequence[StageSpec], settings, versions=code_version) -> dict[str, dict]:
  """{stage name: {"settings", "inputs", "code", "libraries"}} for stages listed inputs-first;
  ``inputs`` holds the full keys of the earlier stages, so any change flows downstream."""
  parts: dict[str, dict] = {}
  for spec in specs:
    missing = [i for i in spec.inputs if i not in parts]
    if missing:
      raise ValueError(f"stage {spec.name} reads {missing}, which are not listed before it")
    parts[spec.name] = {"settings": {f: getattr(settings, f) for f in spec.fields},
                        "inputs": {i: _digest(parts[i]) for i in spec.inputs},
                        "code": versions(spec.modules), "libraries": library_versions(spec.libraries)}
  return parts


class Stage:
  """A cached stage under ``root``: output ``root/name`` and the paths in ``scratch`` (its
  intermediate files), done when ``.<name>.stage.json`` records the same key.

  ``begin()`` keeps a partial output of an interrupted run with the same key (the trainer and
  regeneration resume from it) and deletes one left under another key, scratch included."""

  def __init__(self, root: str, name: str, key_parts: dict, scratch: Sequence[str] = ()):
    self.name, self.parts, self.key = name, key_parts, _digest(key_parts)
    self.dir = os.path.join(root, name)
    self.scratch = [os.path.join(root, s) for s in scratch]
    self.marker = os.path.join(root, f".{name}.stage.json")
    self.started = os.path.join(root, f".{name}.started")

  def _recorded(self) -> dict | None:
    if not os.path.isfile(self.marker):
      return None
    with open(self.marker) as f:
      try:
        return json.load(f)
      except json.JSONDecodeError:
        return None

  def done(self) -> dict | None:
    meta = self._recorded()
    if meta and meta.get("key") == self.key and os.path.exists(self.dir):
      meta.pop("key_parts", None)
      return meta
    return None

  def changed(self) -> list[str]:
    """Which parts of the key differ from the finished output's ([] when none was finished)."""
    meta = self._recorded() or {}
    old = meta.get("key_parts")
    return [] if old is None else [k for k in self.parts if _digest(old.get(k)) != _digest(self.parts[k])]

  def begin(self) -> None:
    started = None
    if os.path.isfile(self.started):
      with open(self.started) as f:
        started = f.read()
    if started != self.key:
      if os.path.lexists(self.marker):
        os.remove(self.marker)
      for path in [self.dir] + self.scratch:
        if os.path.isdir(path):
          shutil.rmtree(path)
        elif os.path.lexists(path):
          os.remove(path)
      with open(self.started, "w") as f:
        f.write(self.key)

  def finish(self, info: dict) -> dict:
    info = dict(info, key=self.key)
    write_json(self.marker, dict(info, key_parts=self.parts), default=str)
    return info
