"""Tracing and lowering for CUDA on a machine without a GPU. Pallas's Triton lowering needs the GPU's
kind to pick its target; with no GPU attached, jax 0.12 takes it from the abstract mesh's
``AbstractDevice`` (jax 0.10 accepts the same context)."""
import contextlib

import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


@contextlib.contextmanager
def cuda_target():
  """Inside: trace, then ``.lower(lowering_platforms=("cuda",))``, as for an H200."""
  mesh = jax.sharding.AbstractMesh((1,), ("cuda_target",), axis_types=(jax.sharding.AxisType.Explicit,),
                                   abstract_device=H200)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def lower_text(fn, *args, **kwargs) -> str:
  """The CUDA lowering (StableHLO text) of ``jax.jit(fn)`` on ``args`` (arrays or ShapeDtypeStructs)."""
  with cuda_target():
    return jax.jit(fn, **kwargs).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
