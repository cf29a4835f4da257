"""Shared fixtures: tiny Hugging Face models saved once per session, and their JAX weights.

``scripts/test.sh`` sets 8 fake CPU devices; the defaults below give the same when pytest is run
directly (they only apply if jax has not been initialised yet).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

try:
  import torch  # noqa: E402
except ImportError:   # the torch-free venv of .ci/run (Python 3.12) runs only the tests that need no torch
  pass
else:
  torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


TEST_CACHE_ENV = "JETSPEC_TEST_CACHE"
TEST_CACHE_MAX_BYTES = 4 << 30     # compiled programs kept: past this, the oldest go at the next run's start


def suite_cache_root() -> str:
  """What the suite keeps across runs: $JETSPEC_TEST_CACHE, else ~/.cache/jetspec-jax/tests (outside the clone;
  the suite never deletes it). ``xla/``: compiled programs; ``quick-demo/``: the reduced demo's stages."""
  return os.environ.get(TEST_CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jetspec-jax", "tests")


def prune(path: str, max_bytes: int) -> None:
  """Delete the least recently modified files under ``path`` until at most ``max_bytes`` remain. Run by the pytest
  controller before its workers start: jax's own size limit evicts while other processes write, and its workers
  then failed to write entries (FileNotFoundError on another entry's access-time file)."""
  entries = []
  for folder, _, names in os.walk(path):
    for name in names:
      try:
        st = os.stat(os.path.join(folder, name))
      except OSError:
        continue
      entries.append((st.st_mtime, st.st_size, os.path.join(folder, name)))
  total = sum(size for _, size, _ in entries)
  for _, size, file in sorted(entries):
    if total <= max_bytes:
      break
    try:
      os.remove(file)
      total -= size
    except OSError:
      pass


def pytest_configure(config):
  """One persistent compilation cache for every pytest process (the controller, each xdist worker) and every
  command the tests start ($JETSPEC_COMPILATION_CACHE), kept across runs. jax keys an entry by the program, the
  XLA flags, the jax and jaxlib versions and the backend, so the suite's -O0 programs, jax 0.10 and 0.12 and the
  device-less stages never collide. The controller prunes it to ``TEST_CACHE_MAX_BYTES`` (oldest first) before
  the workers start. Set before collection, so before the first compile (jax decides once whether the cache is
  on)."""
  from jetspec_jax import cache
  path = os.path.join(suite_cache_root(), "xla")
  os.makedirs(path, exist_ok=True)
  if not hasattr(config, "workerinput"):          # the controller (or a run without workers)
    prune(path, TEST_CACHE_MAX_BYTES)
  os.environ[cache.COMPILATION_CACHE_ENV] = path
  cache.use_compilation_cache(path)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """After each test module, drop jax's caches of compiled programs. Every XLA:CPU executable keeps
  its JIT code mapped; kept for the whole session, the suite's programs passed the kernel's limit of
  65530 memory maps per process (vm.max_map_count), and XLA crashed in a later compile."""
  yield
  jax.clear_caches()


MAP_BUDGET = 40000   # memory maps a worker may hold after a test before its compiled programs are dropped


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
  """After a test, drop jax's compiled programs if the process holds over ``MAP_BUDGET`` memory maps: one module
  (the engine's) compiles enough programs to pass vm.max_map_count (65530) on its own, and XLA then crashed
  serializing an executable for the compilation cache (SIGSEGV)."""
  yield
  try:
    with open("/proc/self/maps") as f:
      maps = sum(1 for _ in f)
  except OSError:                      # no procfs: nothing to measure
    return
  if maps > MAP_BUDGET:
    jax.clear_caches()


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
  """hf_dir(name, dtype='float32', max_shard_size=None) -> path of the saved HF model (cached)."""
  cache = {}

  import hf_fixtures

  def get(name: str, dtype: str = "float32", max_shard_size=None) -> str:
    key = (name, dtype, max_shard_size)
    if key not in cache:
      d = tmp_path_factory.mktemp(f"hf_{name}_{dtype}_{'sharded' if max_shard_size else 'single'}")
      cache[key] = hf_fixtures.save_model(hf_fixtures.named_model(name), str(d), dtype, max_shard_size)
    return cache[key]
  return get


@pytest.fixture(scope="session")
def jax_target(hf_dir):
  """jax_target(name) -> (cfg, params) loaded unsharded in float32 from the saved HF dir (cached)."""
  from jetspec_jax import convert
  cache = {}

  def get(name: str):
    if name not in cache:
      cfg, params, _ = convert.load_target(hf_dir(name), jnp.float32, None)
      cache[name] = (cfg, params)
    return cache[name]
  return get


@pytest.fixture
def eight_devices():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (run via scripts/test.sh: XLA_FLAGS=--xla_force_host_platform_device_count=8)")


@pytest.fixture
def triton_modules(monkeypatch):
  """Collects every Triton module that Pallas lowers during a test and whether MLIR verifies it
  (the CUDA custom call is emitted even for a module that does not verify, which would only fail
  on a GPU). Yields a list of (kernel name, error or None). Uses jax's private lowering hook."""
  from jax._src.pallas.triton import lowering
  seen, lower = [], lowering.lower_jaxpr_to_triton_module

  def checked(jaxpr, *args, **kwargs):
    result = lower(jaxpr, *args, **kwargs)
    try:
      result.module.operation.verify()
      seen.append((str(jaxpr.debug_info.func_name), None))
    except Exception as e:  # noqa: BLE001  (MLIR raises its own error type)
      seen.append((str(jaxpr.debug_info.func_name), str(e).splitlines()[:3]))
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", checked)
  return seen
