"""The flat view of a Flax NNX model's weights, and sharded creation.

A model (``qwen3.Qwen3``, ``draft_head.DraftHead``) declares each weight once, in its module's
``__init__``, as an ``nnx.Param`` whose ``logical_axes`` metadata names its axes. Everything else
derives from that declaration through this module:
  * ``declared_specs``: {name: ParamSpec(shape, axes)} of an abstract model (``nnx.eval_shape``:
    nothing allocated), which sharding, conversion and checkpoint restore read;
  * ``sharded_initializer``: a fresh model's weights made in ONE jit whose outputs land directly in
    their shardings (no unsharded copy on one device);
  * ``flat_params`` / ``bind``: the model's ``nnx.Param`` state as a flat dict {name: array} and back;
  * ``Declared``: those four for one model class, per config (``qwen3.TARGET``, ``draft_head.HEAD``).

A weight's name is its module path joined by dots (``layers.3.attn.q_proj``): the flat dict is
``nnx.split``'s state with the paths spelled out, which is what the jitted loops carry, optax
updates, orbax stores and the Hugging Face table maps.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jetspec_jax.sharding import named_sharding


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """One declared weight: shape and logical axes (for sharding)."""
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, init: str = "normal"
          ) -> nnx.Param:
  """A weight of ``shape`` with its logical ``axes``: N(0, 0.02^2) (drawn in float32) or ones."""
  if init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


def param_name(path) -> str:
  return ".".join(str(p) for p in path)


def _path(name: str) -> tuple:
  return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def declared_specs(abstract_model: nnx.Module) -> dict[str, ParamSpec]:
  """{name: ParamSpec} of every ``nnx.Param`` of a model (abstract or not)."""
  return {param_name(path): ParamSpec(tuple(v.get_value().shape), tuple(v.get_metadata()["logical_axes"]))
          for path, v in nnx.to_flat_state(nnx.state(abstract_model, nnx.Param))}


def flat_params(model: nnx.Module) -> dict[str, jax.Array]:
  """The model's weights as {name: array}."""
  return {param_name(path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def bind(graphdef: nnx.GraphDef, names: frozenset[str], params: dict[str, jax.Array]) -> nnx.Module:
  """The model of ``graphdef`` holding the weights ``names`` of ``params`` (arrays or tracers; used
  inside jit). Other entries of ``params`` (e.g. a test drafter's extra inputs) are not part of it."""
  state = nnx.State.from_flat_path({_path(n): nnx.Param(params[n]) for n in names})
  return nnx.merge(graphdef, state)


def sharded_initializer(make: Callable[[nnx.Rngs], nnx.Module], mesh=None):
  """A jitted key -> {name: array} that builds ``make(nnx.Rngs(key))`` with every weight an output in
  the sharding its axes give on ``mesh`` (so each device computes and holds only its shards)."""
  shardings = None
  if mesh is not None:
    specs = declared_specs(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    shardings = {n: named_sharding(s.axes, s.shape, mesh) for n, s in specs.items()}
  return jax.jit(lambda k: flat_params(make(nnx.Rngs(k))), out_shardings=shardings)


class Declared:
  """What a model class ``model_cls(cfg, *, dtype, rngs)`` derives from its declaration, per config."""

  def __init__(self, model_cls):
    self.model_cls = model_cls
    self._definition = functools.lru_cache(maxsize=32)(self._define)
    self._initializer = functools.lru_cache(maxsize=32)(
        lambda cfg, dtype, mesh: sharded_initializer(lambda rngs: model_cls(cfg, dtype=dtype, rngs=rngs), mesh))

  def abstract(self, cfg) -> nnx.Module:
    """The model with shape-only weights (``nnx.eval_shape``: nothing is allocated)."""
    return nnx.eval_shape(lambda: self.model_cls(cfg, rngs=nnx.Rngs(0)))

  def _define(self, cfg) -> tuple[nnx.GraphDef, frozenset[str]]:
    model = self.abstract(cfg)
    return nnx.split(model)[0], frozenset(declared_specs(model))

  def specs(self, cfg) -> dict[str, ParamSpec]:
    """Every weight as declared by the model: {name: ParamSpec}."""
    return declared_specs(self.abstract(cfg))

  def init(self, cfg, key: jax.Array, dtype=jnp.float32, mesh=None) -> dict[str, jax.Array]:
    """Random weights, each created in its sharding (one jit, compiled once per config, dtype and mesh)."""
    return self._initializer(cfg, dtype, mesh)(key)

  def bind(self, cfg, params: dict[str, jax.Array]) -> nnx.Module:
    """The model of ``cfg`` holding ``params`` (inside jit: the cached graph definition merged with them)."""
    return bind(*self._definition(cfg), params)
