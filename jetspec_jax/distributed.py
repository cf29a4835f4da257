"""Multi-process (multi-host) start-up: one call that works from flags, env vars, SLURM, or alone.

``initialize()`` must run before anything touches a JAX device. Each of the coordinator address, the
number of processes and this process's id is taken from, in order:

1. the explicit argument (``source="flags"``);
2. ``JETSPEC_COORDINATOR`` (``host:port``), ``JETSPEC_NUM_PROCESSES``, ``JETSPEC_PROCESS_ID``
   (``source="env"``; set by ``launch/local.sh`` and ``launch/multinode.sh``);
3. SLURM inside an ``srun`` step: ``SLURM_NTASKS``, ``SLURM_PROCID`` and the first host of
   ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``), port ``JETSPEC_COORDINATOR_PORT``
   (default 12355) (``source="slurm"``).

4. a Cloud TPU VM (a Google TPU on this host's PCI bus, ``on_tpu_vm``) with none of the above: every host of
   the slice runs the same command and ``jax.distributed.initialize()`` is called with no arguments, so jax
   reads the slice's workers from the TPU VM's metadata (GCE) or ``TPU_WORKER_HOSTNAMES`` (GKE)
   (``source="tpu"``; ``JETSPEC_TPU_CLUSTER=0`` turns this off).

With none of these (or a single process) it does nothing and reports ``source="single"`` (or the
source that said one process). ``local_device_ids`` may also come from ``JETSPEC_LOCAL_DEVICE_IDS``
(``"0,1"``); by default every device the process sees is used (JAX's own SLURM detection, which
would restrict each task to one GPU, is switched off).

On CPU, cross-process collectives need an implementation: ``cpu_collectives`` (default ``"gloo"``)
is set with ``jax.config.update("jax_cpu_collectives_implementation", ...)`` before initializing; it
only affects the CPU backend.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import re
import socket
from typing import Iterator, Mapping, Sequence

from jetspec_jax.errors import JetSpecError

ENV_COORDINATOR = "JETSPEC_COORDINATOR"
ENV_NUM_PROCESSES = "JETSPEC_NUM_PROCESSES"
ENV_PROCESS_ID = "JETSPEC_PROCESS_ID"
ENV_COORDINATOR_PORT = "JETSPEC_COORDINATOR_PORT"
ENV_LOCAL_DEVICE_IDS = "JETSPEC_LOCAL_DEVICE_IDS"
ENV_TPU_CLUSTER = "JETSPEC_TPU_CLUSTER"
GOOGLE_PCI_VENDOR = "0x1ae0"          # the PCI vendor id of Google's TPU chips
DEFAULT_PORT = 12355
CPU_COLLECTIVES = ("gloo", "mpi", "megascale")
SOURCES = ("flags", "env", "slurm", "tpu", "single")


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
  """What ``initialize`` decided: this process's index, the process count, and where that came from."""
  process_index: int
  process_count: int
  coordinator: str | None
  source: str  # "flags" | "env" | "slurm" | "tpu" | "single"
  local_device_ids: tuple[int, ...] | None = None

  @property
  def is_multiprocess(self) -> bool:
    return self.process_count > 1


# ----------------------------------------------------------------------------- SLURM node lists


def _split_top_level(text: str, what: str) -> list[str]:
  """Split on commas that are not inside ``[...]``."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch == "[":
      depth += 1
      if depth > 1:
        raise JetSpecError(f"SLURM node list {what!r} has nested brackets")
    elif ch == "]":
      depth -= 1
      if depth < 0:
        raise JetSpecError(f"SLURM node list {what!r} has an unmatched ']'")
    elif ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  if depth != 0:
    raise JetSpecError(f"SLURM node list {what!r} has an unmatched '['")
  parts.append(text[start:])
  return parts


def _expand_range_set(body: str, what: str) -> list[str]:
  """``"001-003,007"`` -> ``["001", "002", "003", "007"]`` (zero padding kept)."""
  out = []
  for item in body.split(","):
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
    if not m:
      raise JetSpecError(f"SLURM node list {what!r} has a bad range {item!r} inside brackets")
    lo, hi = m.group(1), m.group(2)
    if hi is None:
      out.append(lo)
      continue
    if int(hi) < int(lo):
      raise JetSpecError(f"SLURM node list {what!r} has a descending range {item!r}")
    width = len(lo)
    out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
  return out


def _iter_nodelist(nodelist: str) -> Iterator[str]:
  text = nodelist.strip()
  if not text:
    raise JetSpecError("SLURM node list is empty")
  parsed = []  # the whole list is checked before the first name is returned
  for part in _split_top_level(text, text):
    if not part.strip():
      raise JetSpecError(f"SLURM node list {text!r} has an empty entry")
    pieces = re.split(r"(\[[^\]]*\])", part.strip())
    parsed.append([_expand_range_set(p[1:-1], text) if p.startswith("[") else [p] for p in pieces if p])
  for choices in parsed:
    for combo in itertools.product(*choices):
      yield "".join(combo)


def expand_nodelist(nodelist: str) -> list[str]:
  """All hostnames of a SLURM node list: ``"node[001-002,007],gpu1"`` -> 4 names, in order."""
  return list(_iter_nodelist(nodelist))


def first_host(nodelist: str) -> str:
  """The first hostname of a SLURM node list (``"node[001-004,007]"`` -> ``"node001"``)."""
  return next(_iter_nodelist(nodelist))


# ---------------------------------------------------------------------------------- validation


def validate_address(address: str) -> str:
  """Checks ``host:port`` (``[v6]:port`` too) and returns it stripped."""
  if not isinstance(address, str) or not address.strip():
    raise JetSpecError(f"coordinator address must be 'host:port', got {address!r}")
  address = address.strip()
  host, sep, port = address.rpartition(":")
  if not sep or not host:
    raise JetSpecError(f"coordinator address must be 'host:port', got {address!r}")
  if ":" in host and not (host.startswith("[") and host.endswith("]")):
    raise JetSpecError(f"coordinator address {address!r} has an IPv6 host; write it as '[host]:port'")
  if host.startswith("[") != host.endswith("]") or host in ("[]",):
    raise JetSpecError(f"coordinator address {address!r} has a malformed host")
  _port(port, f"coordinator address {address!r}")
  return address


def _port(text, what: str) -> int:
  try:
    port = int(str(text).strip())
  except ValueError:
    raise JetSpecError(f"{what} needs an integer port, got {text!r}") from None
  if not 1 <= port <= 65535:
    raise JetSpecError(f"{what} needs a port in 1..65535, got {port}")
  return port


def _int(value, name: str) -> int:
  if isinstance(value, bool):
    raise JetSpecError(f"{name} must be an integer, got {value!r}")
  if isinstance(value, int):
    return value
  try:
    return int(str(value).strip())
  except ValueError:
    raise JetSpecError(f"{name} must be an integer, got {value!r}") from None


def validate(num_processes: int, process_id: int, coordinator: str | None) -> None:
  """Checks ``num_processes >= 1``, ``0 <= process_id < num_processes`` and, past one process, the address."""
  if num_processes < 1:
    raise JetSpecError(f"the number of processes must be at least 1, got {num_processes}")
  if not 0 <= process_id < num_processes:
    raise JetSpecError(f"process id must be in 0..{num_processes - 1} for {num_processes} process(es), "
                       f"got {process_id}")
  if num_processes > 1:
    if coordinator is None:
      raise JetSpecError(f"{num_processes} processes need a coordinator address "
                         f"(argument coordinator_address or ${ENV_COORDINATOR})")
    validate_address(coordinator)


def _parse_device_ids(value) -> tuple[int, ...] | None:
  if value is None:
    return None
  if isinstance(value, str):
    items = [t for t in value.replace(" ", "").split(",") if t]
  elif isinstance(value, int) and not isinstance(value, bool):
    items = [value]
  else:
    items = list(value)
  try:
    ids = tuple(_int(t, "local device id") for t in items)
  except JetSpecError:
    raise JetSpecError(f"local device ids must be comma-separated integers, got {value!r}") from None
  if not ids or any(i < 0 for i in ids):
    raise JetSpecError(f"local device ids must be non-negative integers, got {value!r}")
  return ids


# ---------------------------------------------------------------------------------- resolution


def slurm_settings(env: Mapping[str, str] | None = None) -> dict | None:
  """``{"coordinator", "num_processes", "process_id"}`` from a SLURM step's variables, or None outside one."""
  env = os.environ if env is None else env
  nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
  if "SLURM_NTASKS" not in env or "SLURM_PROCID" not in env or not nodelist:
    return None
  port = _port(env.get(ENV_COORDINATOR_PORT, DEFAULT_PORT), f"${ENV_COORDINATOR_PORT}")
  host = first_host(nodelist)
  return {"coordinator": f"{host}:{port}",
          "num_processes": _int(env["SLURM_NTASKS"], "$SLURM_NTASKS"),
          "process_id": _int(env["SLURM_PROCID"], "$SLURM_PROCID")}


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, local_device_ids=None,
            env: Mapping[str, str] | None = None) -> DistributedInfo:
  """What ``initialize`` would do with these arguments in ``env`` (default ``os.environ``); pure."""
  env = os.environ if env is None else env
  flags = {"coordinator": coordinator_address, "num_processes": num_processes, "process_id": process_id}
  envs = {"coordinator": env.get(ENV_COORDINATOR) or None,
          "num_processes": env.get(ENV_NUM_PROCESSES) or None,
          "process_id": env.get(ENV_PROCESS_ID) or None}
  names = {"num_processes": f"${ENV_NUM_PROCESSES}", "process_id": f"${ENV_PROCESS_ID}"}
  slurm = None
  if any(flags[k] is None and envs[k] is None for k in flags):
    slurm = slurm_settings(env)

  chosen, used = {}, set()
  for key in ("coordinator", "num_processes", "process_id"):
    if flags[key] is not None:
      chosen[key], src = flags[key], "flags"
      if key != "coordinator":
        chosen[key] = _int(chosen[key], key)
    elif envs[key] is not None:
      chosen[key], src = envs[key], "env"
      if key != "coordinator":
        chosen[key] = _int(chosen[key], names[key])
    elif slurm is not None:
      chosen[key], src = slurm[key], "slurm"
    else:
      chosen[key], src = None, None
    if src:
      used.add(src)

  source = next((s for s in SOURCES if s in used), "single")
  n, pid, coord = chosen["num_processes"], chosen["process_id"], chosen["coordinator"]
  if local_device_ids is None:
    local_device_ids = env.get(ENV_LOCAL_DEVICE_IDS) or None
  if n is None and pid is None and coord is None:
    return DistributedInfo(0, 1, None, "single", _parse_device_ids(local_device_ids))
  if n is None:
    if (pid is not None and pid != 0) or coord is not None:
      raise JetSpecError(f"the number of processes is missing (argument num_processes or ${ENV_NUM_PROCESSES}) "
                         f"while a process id or coordinator is given")
    n = 1
  if pid is None:
    if n > 1:
      raise JetSpecError(f"the process id is missing for {n} processes (argument process_id or ${ENV_PROCESS_ID})")
    pid = 0
  if isinstance(coord, str):
    coord = coord.strip() or None
  validate(n, pid, coord)
  return DistributedInfo(pid, n, coord, source, _parse_device_ids(local_device_ids))


def on_tpu_vm(pci_root: str = "/sys/bus/pci/devices") -> bool:
  """Whether this host has a Google TPU chip on its PCI bus (a Cloud TPU VM), read from ``pci_root``."""
  try:
    names = os.listdir(pci_root)
  except OSError:
    return False
  for name in names:
    try:
      with open(os.path.join(pci_root, name, "vendor")) as f:
        if f.read().strip().lower() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def tpu_cluster(info: DistributedInfo, env: Mapping[str, str] | None = None, pci_root: str = "/sys/bus/pci/devices"
                ) -> bool:
  """Whether ``initialize`` hands start-up to jax's TPU cluster detection: nothing named a coordinator, a process
  count or an id (``info.source == "single"``), this is a Cloud TPU VM, and ``JETSPEC_TPU_CLUSTER`` is not 0."""
  env = os.environ if env is None else env
  return info.source == "single" and env.get(ENV_TPU_CLUSTER, "1") != "0" and on_tpu_vm(pci_root)


_STATE: dict = {"info": None}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: int | Sequence[int] | str | None = None,
               cpu_collectives: str | None = "gloo", *, initialization_timeout: int = 300,
               heartbeat_timeout_seconds: int = 100, shutdown_timeout_seconds: int = 300) -> DistributedInfo:
  """Start ``jax.distributed`` from flags, ``JETSPEC_*`` env vars or SLURM; a no-op for one process.

  Call it first, before any JAX computation or ``jax.devices()``. Calling it again returns the first
  result. ``cpu_collectives`` is one of ``"gloo"`` (default), ``"mpi"``, ``"megascale"``, or None to
  leave JAX's setting alone. The timeouts (seconds) are passed to ``jax.distributed.initialize``.
  """
  if _STATE["info"] is not None:
    return _STATE["info"]
  if cpu_collectives is not None and cpu_collectives not in CPU_COLLECTIVES:
    raise JetSpecError(f"cpu_collectives must be one of {', '.join(CPU_COLLECTIVES)} or None, "
                       f"got {cpu_collectives!r}")
  info = resolve(coordinator_address, num_processes, process_id, local_device_ids)
  tpu = tpu_cluster(info)
  if info.process_count == 1 and not tpu:
    _STATE["info"] = info
    return info

  import jax
  if jax.distributed.is_initialized():
    raise JetSpecError("jax.distributed is already initialized by someone else; call "
                       "jetspec_jax.distributed.initialize() instead, once, at start-up")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  where = {} if tpu else {"coordinator_address": info.coordinator, "num_processes": info.process_count,
                          "process_id": info.process_index, "cluster_detection_method": "deactivate"}
  try:
    jax.distributed.initialize(
        **where, local_device_ids=list(info.local_device_ids) if info.local_device_ids is not None else None,
        initialization_timeout=int(initialization_timeout), heartbeat_timeout_seconds=int(heartbeat_timeout_seconds),
        shutdown_timeout_seconds=int(shutdown_timeout_seconds))
  except (RuntimeError, ValueError) as e:
    if "must be called before" in str(e):
      raise JetSpecError("jetspec_jax.distributed.initialize() must run before any JAX computation or "
                         "jax.devices() call in this process") from e
    if tpu:
      raise JetSpecError(f"this Cloud TPU VM could not join its slice's other hosts (jax's TPU cluster detection): "
                         f"{str(e).splitlines()[0] if str(e) else e!r}; set {ENV_TPU_CLUSTER}=0 to run it alone") from e
    raise JetSpecError(f"process {info.process_index}/{info.process_count} could not join the coordinator at "
                       f"{info.coordinator} ({info.source}): {str(e).splitlines()[0] if str(e) else e!r}") from e
  if tpu:
    info = dataclasses.replace(info, process_index=jax.process_index(), process_count=jax.process_count(),
                               source="tpu")
  _STATE["info"] = info
  return info


def info() -> DistributedInfo | None:
  """The result of the first ``initialize`` call, or None before it."""
  return _STATE["info"]


def describe() -> dict:
  """A JSON-able summary for logs: process, devices, coordinator and where the settings came from."""
  import jax
  current = _STATE["info"]
  devices = jax.local_devices()
  return {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "source": current.source if current else None,
      "coordinator": current.coordinator if current else None,
      "local_device_ids": list(current.local_device_ids) if current and current.local_device_ids else None,
      "hostname": socket.gethostname(),
      "pid": os.getpid(),
      "backend": jax.default_backend(),
      "local_device_count": jax.local_device_count(),
      "device_count": jax.device_count(),
      "local_devices": [str(d) for d in devices],
      "device_kind": devices[0].device_kind if devices else None,
      "jax_version": jax.__version__,
  }


def host_values(tree):
  """Host numpy copies of a pytree of arrays, identical on every process: a plain ``device_get`` in
  one process, else gathered across processes (arrays sharded over devices that other processes own
  cannot be read locally). In several processes every process must call it."""
  import jax
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)


def from_first_process(value):
  """Process 0's ``value`` (anything JSON can hold) on every process; ``value`` of the others is ignored.
  One process: ``value`` itself. In several processes every process must call it (two broadcasts: the
  length of the JSON text, then the text)."""
  import json

  import jax
  import numpy as np
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  text = json.dumps(value).encode() if jax.process_index() == 0 else b""
  length = int(multihost_utils.broadcast_one_to_all(np.array([len(text)], np.int32))[0])
  padded = np.zeros(length, np.uint8)
  padded[:len(text)] = np.frombuffer(text, np.uint8)
  return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded), np.uint8)).decode())
