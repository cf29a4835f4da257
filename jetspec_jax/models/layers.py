"""Building blocks shared by the Qwen3 target and the draft head: norms, RoPE, projections."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """One weight, declared once: shape, logical axes (for sharding) and initialiser name."""
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str = "normal"   # "normal" (std 0.02) | "ones"


def init_param(spec: ParamSpec, key: jax.Array, dtype) -> jax.Array:
  """A freshly initialised weight for ``spec``."""
  if spec.init == "ones":
    return jnp.ones(spec.shape, dtype)
  return (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def init_params(specs: dict[str, ParamSpec], key: jax.Array, dtype, mesh=None) -> dict[str, jax.Array]:
  """Initialise every declared weight in ONE jit whose outputs land directly in their shardings."""
  from jetspec_jax.sharding import named_sharding
  names = sorted(specs)
  shardings = {n: named_sharding(specs[n].axes, specs[n].shape, mesh) for n in names} if mesh is not None else None

  def make(k):
    keys = jax.random.split(k, len(names))
    return {n: init_param(specs[n], keys[i], dtype) for i, n in enumerate(names)}

  return jax.jit(make, out_shardings=shardings)(key)


def attention_specs(pre: str, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, ParamSpec]:
  """The attention block's weights and both pre-norms of one decoder layer (target and head alike)."""
  return {
      pre + "input_norm": ParamSpec((hidden,), ("norm",), "ones"),
      pre + "post_attn_norm": ParamSpec((hidden,), ("norm",), "ones"),
      pre + "q_proj": ParamSpec((hidden, num_heads, head_dim), ("embed", "q_heads", "head_dim")),
      pre + "k_proj": ParamSpec((hidden, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim")),
      pre + "v_proj": ParamSpec((hidden, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim")),
      pre + "o_proj": ParamSpec((num_heads, head_dim, hidden), ("q_heads", "head_dim", "embed")),
      pre + "q_norm": ParamSpec((head_dim,), ("norm",), "ones"),
      pre + "k_norm": ParamSpec((head_dim,), ("norm",), "ones"),
  }


def dense_mlp_specs(pre: str, hidden: int, intermediate: int) -> dict[str, ParamSpec]:
  """SwiGLU MLP weights of one decoder layer."""
  return {pre + "mlp.gate": ParamSpec((hidden, intermediate), ("embed", "mlp")),
          pre + "mlp.up": ParamSpec((hidden, intermediate), ("embed", "mlp")),
          pre + "mlp.down": ParamSpec((intermediate, hidden), ("mlp", "embed"))}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32 then cast back (as transformers)."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotate-half RoPE. x [B, T, H, Dh], positions [B, T] int -> same shape and dtype."""
  head_dim = x.shape[-1]
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)   # [B, T, Dh/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = head_dim // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
  """down(silu(x @ gate) * (x @ up)); gate/up [H, I], down [I, H]."""
  return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def dense_mlp(p: Callable[[str], jax.Array]) -> Callable[[jax.Array], jax.Array]:
  """The SwiGLU MLP of a layer whose weights ``p(name)`` returns."""
  return lambda h: swiglu(h, p("mlp.gate"), p("mlp.up"), p("mlp.down"))


def decoder_layer(x: jax.Array, p: Callable[[str], jax.Array], attend, mlp, *, num_heads: int, num_kv_heads: int,
                  head_dim: int, eps: float, theta: float, positions: jax.Array) -> jax.Array:
  """One pre-norm Qwen3 decoder layer over x [B, T, H]:
  x + o_proj(attend(q, k, v)), then + mlp(post_attn_norm(x)). ``attend`` maps q [B,T,Hq,Dh] and the
  rows' own k, v [B,Hkv,T,Dh] to [B,T,Hq,Dh] (it decides which other keys are visible)."""
  h = rms_norm(x, p("input_norm"), eps)
  q, k, v = attention_block(h, h, p, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps,
                            theta=theta, q_positions=positions, kv_positions=positions)
  x = x + jnp.einsum("btnd,ndh->bth", attend(q, k, v), p("o_proj"))
  return x + mlp(rms_norm(x, p("post_attn_norm"), eps))


def write_rows(cache: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
  """Write ``rows`` [B, Hkv, T, Dh] into ``cache`` [B, Hkv, S, Dh] at per-sequence offsets start [B]."""
  def one(c, r, s):
    return jax.lax.dynamic_update_slice(c, r.astype(c.dtype), (0, s, 0))
  return jax.vmap(one)(cache, rows, start.astype(jnp.int32))


def attention_block(q_in: jax.Array, kv_in: jax.Array, p: Callable[[str], jax.Array], *, num_heads: int,
                    num_kv_heads: int, head_dim: int, eps: float, theta: float,
                    q_positions: jax.Array, kv_positions: jax.Array):
  """Projections + per-head q/k RMSNorm + RoPE. Returns q [B,T,Hq,Dh], k, v [B,Hkv,Tk,Dh]."""
  q = jnp.einsum("bth,hnd->btnd", q_in, p("q_proj"))
  k = jnp.einsum("bth,hnd->btnd", kv_in, p("k_proj"))
  v = jnp.einsum("bth,hnd->btnd", kv_in, p("v_proj"))
  q = rope(rms_norm(q, p("q_norm"), eps), q_positions, theta)
  k = rope(rms_norm(k, p("k_norm"), eps), kv_positions, theta)
  return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
