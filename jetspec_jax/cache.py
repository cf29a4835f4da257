"""What persists across runs: the cache root (the demo's stages, ``$JETSPEC_CACHE``) and jax's persistent
compilation cache (compiled programs, ``xla/`` under the root unless the user says otherwise)."""
from __future__ import annotations

import os
import sys
from typing import Mapping

from jetspec_jax.errors import JetSpecError

CACHE_ROOT_ENV = "JETSPEC_CACHE"
COMPILATION_CACHE_ENV = "JETSPEC_COMPILATION_CACHE"
MIN_COMPILE_S = 0.2     # programs that compile faster than this are not written to the cache


def default_root(env: Mapping[str, str] = os.environ) -> str:
  """$JETSPEC_CACHE, else ~/.cache/jetspec-jax."""
  return env.get(CACHE_ROOT_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jetspec-jax")


def compilation_cache_dir(flag: str | None, env: Mapping[str, str], jax_dir: str | None,
                          workdir: str | None) -> str | None:
  """Where compiled programs persist across runs, or None (off).

  ``flag`` (``--compilation-cache DIR|off``) first, then $JETSPEC_COMPILATION_CACHE (DIR|off), then a cache
  directory jax already has ($JAX_COMPILATION_CACHE_DIR), then ``xla`` under ``workdir`` or the cache root."""
  choice = flag if flag is not None else env.get(COMPILATION_CACHE_ENV)
  if choice is None:
    if jax_dir:
      return jax_dir
    choice = os.path.join(workdir or default_root(env), "xla")
  return None if choice.strip().lower() in ("off", "none", "") else os.path.abspath(os.path.expanduser(choice))


def usable_cache_dir(path: str, asked: bool) -> str | None:
  """``path`` once it exists as a directory. When it cannot be created: an error if the user ``asked`` for
  it, else a warning on stderr and None (the run compiles as usual)."""
  try:
    os.makedirs(path, exist_ok=True)
    return path
  except OSError as e:
    problem = f"cannot create the compilation cache directory {path} ({e.strerror})"
    if asked:
      raise JetSpecError(f"{problem}; pass --compilation-cache DIR or --compilation-cache off") from None
    print(f"warning: {problem}; compiling without a cache (--compilation-cache DIR picks another place)",
          file=sys.stderr)
    return None


def enable_compilation_cache(flag: str | None = None, env: Mapping[str, str] = os.environ,
                             workdir: str | None = None) -> str | None:
  """Points jax's persistent compilation cache at ``compilation_cache_dir`` (or turns it off); returns the
  directory or None. Call before the process's first compile (jax decides once whether the cache is on)."""
  import jax
  jax_dir = jax.config.jax_compilation_cache_dir
  path = compilation_cache_dir(flag, env, jax_dir, workdir)
  if path is not None:
    path = usable_cache_dir(path, asked=flag is not None or COMPILATION_CACHE_ENV in env or path == jax_dir)
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  if path != jax_dir:
    use_compilation_cache(path)
  return path


def use_compilation_cache(path: str) -> None:
  """Makes ``path`` jax's persistent compilation cache for programs that take MIN_COMPILE_S or more to
  compile."""
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
