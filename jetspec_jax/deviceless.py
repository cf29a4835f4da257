"""Compiling for GPUs that are not attached: jax's CUDA plugin builds XLA:GPU programs for a described
device on any machine, so memory, fusion and control flow of a GPU program can be read without one.

Needs ``jax[cuda12]`` at jax's own version (plus ``absl-py`` for Mosaic GPU kernels) and runs with
``JAX_PLATFORMS=cpu`` (set here when unset) and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (no driver). The
target is XLA's ``GpuTargetConfig`` text for an H200 (132 SMs, 4.8 TB/s, sm_90). ``cost_analysis()``
is None for such programs; ``memory_analysis()`` and ``as_text()`` work.

TPUs likewise (``tpu_devices``): ``jax[tpu]`` (libtpu) at jax's version, ``JAX_PLATFORMS=cpu``, a chip or
slice topology by name; there ``cost_analysis()`` gives a program's FLOPs and bytes accessed.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import jax

from jetspec_jax.errors import JetSpecError
from jetspec_jax.sharding import make_mesh

H200 = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150000000000 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H200"
"""


def available() -> bool:
  """Whether jax's CUDA plugin is installed (it compiles for a GPU without one)."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    return False


def require() -> None:
  """Raise JetSpecError, in one sentence, when compiling for a GPU is not possible here."""
  if not available():
    raise JetSpecError(f"compiling for an H200 needs jax's CUDA plugin: pip install \"jax[cuda12]=={jax.__version__}\" "
                       "absl-py (about 5.5 GB; no GPU needed)")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


@functools.lru_cache(maxsize=None)
def h200_devices(count: int = 8) -> tuple:
  """``count`` H200 devices of one host (no GPU attached): for meshes, shardings and ``.compile()``."""
  require()
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(platform="cuda", target_config=H200, topology=f"1x1x{count}")
  return tuple(topology.devices)


def h200_mesh(data: int, model: int):
  """A (data, model) mesh of data * model H200s (``sharding.make_mesh``'s axes)."""
  return make_mesh(data, model, h200_devices(data * model))


# One chip of each kind, and the 8-core slices teams start on (v5p-8: 4 chips of 2 cores, one device each).
TPU_TOPOLOGIES = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "v5p": "v5p:1x1x1",
                  "v5e-8": "v5e:2x4", "v6e-8": "v6e:2x4", "v5p-8": "v5p:2x2x1"}


def tpu_available() -> bool:
  """Whether libtpu is installed (it compiles for a TPU without one)."""
  return importlib.util.find_spec("libtpu") is not None


@functools.lru_cache(maxsize=None)
def tpu_devices(chip: str) -> tuple:
  """The chips of a TPU ``chip`` or slice (``TPU_TOPOLOGIES``), no TPU attached: for meshes, shardings and
  ``.compile()``."""
  if not tpu_available():
    raise JetSpecError(f"compiling for a TPU needs libtpu: pip install \"jax[tpu]=={jax.__version__}\" in its own "
                       "venv (no TPU needed)")
  if chip not in TPU_TOPOLOGIES:
    raise JetSpecError(f"unknown TPU chip or slice {chip!r}; choose from {', '.join(TPU_TOPOLOGIES)}")
  from jax.experimental import topologies
  return tuple(topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[chip], platform="tpu").devices)
