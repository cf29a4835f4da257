"""jetspec_jax.distributed (env/SLURM resolution, node lists, validation), a real 2-process run, and launch/."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jetspec_jax import distributed as dist
from jetspec_jax.errors import JetSpecError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")

# ------------------------------------------------------------------------------------ node lists


@pytest.mark.parametrize("nodelist,first", [
    ("node001", "node001"),
    ("node[001-004,007]", "node001"),
    ("node[007,001-004]", "node007"),
    ("gpu-a[09-11],gpu-b3", "gpu-a09"),
    ("host1,host2", "host1"),
    ("rack[2-3]-n[08-09]", "rack2-n08"),
    ("x[5]", "x5"),
    (" node[1-2] ", "node1"),
])
def test_first_host(nodelist, first):
  assert dist.first_host(nodelist) == first


def test_expand_nodelist():
  assert dist.expand_nodelist("node[001-003,007],gpu1") == ["node001", "node002", "node003", "node007", "gpu1"]
  assert dist.expand_nodelist("r[1-2]-n[8-10]") == ["r1-n8", "r1-n9", "r1-n10", "r2-n8", "r2-n9", "r2-n10"]
  assert dist.expand_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]


@pytest.mark.parametrize("bad,match", [
    ("", "empty"),
    ("node[001-004", "unmatched '\\['"),
    ("node001]", "unmatched '\\]'"),
    ("node[a-b]", "bad range"),
    ("node[4-1]", "descending"),
    ("a,,b", "empty entry"),
    ("n[[1]]", "nested"),
])
def test_bad_nodelist(bad, match):
  with pytest.raises(JetSpecError, match=match):
    dist.first_host(bad)


# ----------------------------------------------------------------------------------- resolution


def test_nothing_set_is_single_process():
  info = dist.resolve(env={})
  assert info == dist.DistributedInfo(0, 1, None, "single", None)
  assert not info.is_multiprocess


def test_flags_win_over_env_and_slurm():
  env = {"JETSPEC_COORDINATOR": "envhost:1", "JETSPEC_NUM_PROCESSES": "8", "JETSPEC_PROCESS_ID": "7",
         "SLURM_NTASKS": "16", "SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "n[1-16]"}
  info = dist.resolve("flaghost:2", 4, 2, env=env)
  assert (info.coordinator, info.process_count, info.process_index, info.source) == ("flaghost:2", 4, 2, "flags")


def test_env():
  env = {"JETSPEC_COORDINATOR": "10.0.0.1:1234", "JETSPEC_NUM_PROCESSES": "4", "JETSPEC_PROCESS_ID": "3",
         "SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "n[1-16]"}
  info = dist.resolve(env=env)
  assert (info.coordinator, info.process_count, info.process_index, info.source) == ("10.0.0.1:1234", 4, 3, "env")


def test_flags_and_env_mix_per_field():
  env = {"JETSPEC_COORDINATOR": "h:9", "JETSPEC_NUM_PROCESSES": "2"}
  info = dist.resolve(process_id=1, env=env)
  assert (info.coordinator, info.process_count, info.process_index, info.source) == ("h:9", 2, 1, "flags")


def test_slurm():
  env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_STEP_NODELIST": "gpu[012-015]",
         "SLURM_JOB_NODELIST": "other[1-9]"}
  info = dist.resolve(env=env)
  assert (info.coordinator, info.process_count, info.process_index, info.source) == ("gpu012:12355", 4, 2, "slurm")
  env2 = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "a[7-8]", "JETSPEC_COORDINATOR_PORT": "4000"}
  assert dist.resolve(env=env2).coordinator == "a7:4000"
  # a JETSPEC_COORDINATOR overrides only the address; the counts still come from SLURM
  info3 = dist.resolve(env={**env, "JETSPEC_COORDINATOR": "10.1.1.1:555"})
  assert (info3.coordinator, info3.process_count, info3.process_index, info3.source) == ("10.1.1.1:555", 4, 2, "env")
  # no node list: not a usable SLURM step
  assert dist.slurm_settings({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}) is None
  assert dist.resolve(env={"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}).source == "single"


def test_single_task_slurm_step_is_single_process():
  info = dist.resolve(env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n1"})
  assert info.process_count == 1 and info.source == "slurm"


def test_local_device_ids():
  assert dist.resolve(local_device_ids=[0, 1], env={}).local_device_ids == (0, 1)
  assert dist.resolve(local_device_ids=3, env={}).local_device_ids == (3,)
  assert dist.resolve(env={"JETSPEC_LOCAL_DEVICE_IDS": "2, 3"}).local_device_ids == (2, 3)
  with pytest.raises(JetSpecError, match="local device ids"):
    dist.resolve(env={"JETSPEC_LOCAL_DEVICE_IDS": "a,b"})
  with pytest.raises(JetSpecError, match="local device ids"):
    dist.resolve(local_device_ids=[-1], env={})


@pytest.mark.parametrize("kwargs,env,match", [
    ({"coordinator_address": "h:1", "num_processes": 0, "process_id": 0}, {}, "at least 1"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, {}, "process id must be in 0..1"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": -1}, {}, "process id must be in 0..1"),
    ({"num_processes": 2, "process_id": 0}, {}, "need a coordinator address"),
    ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, {}, "host:port"),
    ({"coordinator_address": ":80", "num_processes": 2, "process_id": 0}, {}, "host:port"),
    ({"coordinator_address": "h:http", "num_processes": 2, "process_id": 0}, {}, "integer port"),
    ({"coordinator_address": "h:70000", "num_processes": 2, "process_id": 0}, {}, "1..65535"),
    ({"coordinator_address": "::1:80", "num_processes": 2, "process_id": 0}, {}, "IPv6"),
    ({"coordinator_address": "h:1", "process_id": 1}, {}, "number of processes is missing"),
    ({"coordinator_address": "h:1", "num_processes": 2}, {}, "process id is missing"),
    ({}, {"JETSPEC_NUM_PROCESSES": "two", "JETSPEC_PROCESS_ID": "0", "JETSPEC_COORDINATOR": "h:1"},
     "JETSPEC_NUM_PROCESSES must be an integer"),
    ({}, {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-4]",
          "JETSPEC_COORDINATOR_PORT": "x"}, "JETSPEC_COORDINATOR_PORT needs an integer port"),
    ({}, {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-4"}, "unmatched"),
])
def test_validation_errors(kwargs, env, match):
  with pytest.raises(JetSpecError, match=match):
    dist.resolve(**kwargs, env=env)


def test_ipv6_and_hostname_addresses_are_valid():
  assert dist.validate_address("[::1]:1234") == "[::1]:1234"
  assert dist.validate_address(" node-01.cluster:80 ") == "node-01.cluster:80"


def test_initialize_single_process_is_a_noop(monkeypatch):
  for k in list(os.environ):
    if k.startswith(("JETSPEC_", "SLURM_")):
      monkeypatch.delenv(k)
  monkeypatch.setitem(dist._STATE, "info", None)
  import jax
  info = dist.initialize()
  assert info.source == "single" and info.process_count == 1
  assert not jax.distributed.is_initialized()
  d = dist.describe()
  assert d["process_index"] == 0 and d["process_count"] == 1 and d["source"] == "single"
  json.dumps(d)
  with pytest.raises(JetSpecError, match="cpu_collectives"):
    monkeypatch.setitem(dist._STATE, "info", None)
    dist.initialize(cpu_collectives="nccl")


def _pci(root, *vendors):
  for i, vendor in enumerate(vendors):
    os.makedirs(root / f"0000:00:0{i}.0")
    (root / f"0000:00:0{i}.0" / "vendor").write_text(vendor + "\n")
  return str(root)


def test_a_cloud_tpu_vm_is_told_by_a_google_chip_on_the_pci_bus(tmp_path):
  assert dist.on_tpu_vm(_pci(tmp_path / "tpu", "0x8086", "0x1ae0"))
  assert not dist.on_tpu_vm(_pci(tmp_path / "gpu", "0x8086", "0x10de"))
  assert not dist.on_tpu_vm(str(tmp_path / "missing"))


def test_jax_finds_a_tpu_slice_only_when_nothing_else_says_how(tmp_path):
  tpu = _pci(tmp_path, "0x1ae0")
  single = dist.resolve(env={})
  assert dist.tpu_cluster(single, {}, tpu) and not dist.tpu_cluster(single, {}, str(tmp_path / "none"))
  assert not dist.tpu_cluster(single, {"JETSPEC_TPU_CLUSTER": "0"}, tpu)
  told = dist.resolve(env={"JETSPEC_COORDINATOR": "h:1", "JETSPEC_NUM_PROCESSES": "2", "JETSPEC_PROCESS_ID": "1"})
  assert not dist.tpu_cluster(told, {}, tpu)


def test_a_tpu_vm_that_finds_no_slice_says_so_in_one_sentence():
  """The TPU path calls the real ``jax.distributed.initialize()`` with no arguments; off a TPU VM jax's cluster
  detection finds nothing, and the error names the way out."""
  code = ("from jetspec_jax import distributed as d; d.on_tpu_vm = lambda *a: True\n"
          "try:\n  d.initialize(initialization_timeout=5)\nexcept d.JetSpecError as e:\n  print('ERR', e)")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_child_env(1))
  assert r.returncode == 0 and "ERR this Cloud TPU VM could not join" in r.stdout, r.stdout + r.stderr
  assert "JETSPEC_TPU_CLUSTER=0" in r.stdout


def test_initialize_after_jax_started_is_a_clear_error(monkeypatch):
  import jax
  jax.devices()  # the backend is up, so jax.distributed can no longer start (and nothing can hang)
  monkeypatch.setitem(dist._STATE, "info", None)
  with pytest.raises(JetSpecError, match="must run before any JAX computation"):
    dist.initialize("127.0.0.1:1", 2, 1, initialization_timeout=1)
  assert dist.info() is None


# ------------------------------------------------------------------ real multi-process runs

_TIMEOUT_S = 50


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(devices: int = 2) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JETSPEC_", "SLURM_"))}
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run_all(cmds, env, timeout=_TIMEOUT_S):
  """Run the commands concurrently (own process groups); kill every group on timeout. -> [(rc, out, err)]"""
  procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=ROOT) for c in cmds]
  deadline = time.monotonic() + timeout
  results = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      results.append((p.returncode, out, err))
  except subprocess.TimeoutExpired:
    for p in procs:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    for p in procs:
      p.communicate()
    pytest.fail(f"multi-process run did not finish within {timeout}s")
  return results


WORKER = textwrap.dedent("""
    import json, sys
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    from jetspec_jax import distributed
    info = distributed.initialize(f"127.0.0.1:{port}", 2, pid, cpu_collectives="gloo", initialization_timeout=30,
                                  heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert jax.config.jax_cpu_collectives_implementation == "gloo"
    mesh = Mesh(np.array(jax.devices()), ("d",))
    local = np.arange(4, dtype=np.float32) + 4 * jax.process_index()   # process 0: 0..3, process 1: 4..7
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local, (8,))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v.sum(keepdims=True), "d"), mesh=mesh,
                                 in_specs=P("d"), out_specs=P()))(x)
    print("RESULT " + json.dumps({
        "info": [info.process_index, info.process_count, info.coordinator, info.source],
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
        "sum": float(total), "psum": np.asarray(psum).tolist(),
        "describe": distributed.describe()}), flush=True)
""")


def _result(out: str) -> dict:
  lines = [line for line in out.splitlines() if "RESULT " in line]
  assert len(lines) == 1, out
  return json.loads(lines[0].split("RESULT ", 1)[1])


def test_two_processes_gloo_global_sum(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(WORKER)
  port = _free_port()
  results = _run_all([[sys.executable, str(script), str(i), str(port)] for i in range(2)], _child_env(2))
  for i, (rc, out, err) in enumerate(results):
    assert rc == 0, f"process {i} failed (rc {rc}):\n{out}\n{err[-3000:]}"
    r = _result(out)
    assert r["info"] == [i, 2, f"127.0.0.1:{port}", "flags"]
    assert (r["process_index"], r["process_count"]) == (i, 2)
    assert (r["device_count"], r["local_device_count"]) == (4, 2)
    assert r["sum"] == 28.0 and r["psum"] == [28.0]
    assert r["describe"]["process_index"] == i and r["describe"]["device_count"] == 4


# ---------------------------------------------------------------------------------------- launch/


@pytest.mark.parametrize("script", ["local.sh", "multinode.sh", "slurm.sbatch", "tpu_vm.sh"])
def test_scripts_parse(script):
  subprocess.run(["bash", "-n", os.path.join(LAUNCH, script)], check=True, timeout=10)


def test_local_sh_runs_a_real_two_process_job():
  code = ("from jetspec_jax.distributed import initialize; info = initialize(initialization_timeout=30, "
          "shutdown_timeout_seconds=10); import jax; "
          "print('PROC', jax.process_index(), jax.process_count(), jax.device_count(), info.source, flush=True)")
  cmd = ["bash", os.path.join(LAUNCH, "local.sh"), "-n", "2", "--cpu-devices", "2", "--port", str(_free_port()),
         "--", sys.executable, "-c", code]
  env = _child_env(8)  # local.sh must replace the device count, not add to it
  [(rc, out, err)] = _run_all([cmd], env)
  assert rc == 0, out + err
  procs = sorted(line for line in out.splitlines() if "PROC" in line)
  assert procs == ["[0] PROC 0 2 4 env", "[1] PROC 1 2 4 env"], out + err


def test_local_sh_stops_the_others_when_one_fails():
  code = ("import os, sys, time; i = int(os.environ['JETSPEC_PROCESS_ID']); print('up', i, flush=True); "
          "sys.exit(3) if i == 1 else time.sleep(60)")
  cmd = ["bash", os.path.join(LAUNCH, "local.sh"), "-n", "3", "--", sys.executable, "-c", code]
  t0 = time.monotonic()
  [(rc, out, err)] = _run_all([cmd], _child_env(1), timeout=30)
  assert rc == 3, out + err
  assert time.monotonic() - t0 < 20
  assert "process 1 exited with status 3" in err


def test_local_sh_rejects_bad_usage():
  for args in (["-n", "0", "--", "true"], ["--cpu-devices", "x", "--", "true"], ["-n", "2"], ["--bogus"]):
    r = subprocess.run(["bash", os.path.join(LAUNCH, "local.sh"), *args], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and r.stderr.startswith("local.sh: "), (args, r.stderr)


def test_multinode_sh_sets_env_and_validates():
  probe = [sys.executable, "-c", "import os; print(os.environ['JETSPEC_COORDINATOR'], "
           "os.environ['JETSPEC_NUM_PROCESSES'], os.environ['JETSPEC_PROCESS_ID'])"]
  r = subprocess.run(["bash", os.path.join(LAUNCH, "multinode.sh"), "10.0.0.1:1234", "4", "3", "--", *probe],
                     capture_output=True, text=True, timeout=10, env=_child_env(1))
  assert r.returncode == 0 and r.stdout.split() == ["10.0.0.1:1234", "4", "3"], r.stderr
  for args in (["h:1", "2", "2"], ["h", "2", "0"], ["h:1", "0", "0"], ["h:1", "2"]):
    r = subprocess.run(["bash", os.path.join(LAUNCH, "multinode.sh"), *args, "--", "true"],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "multinode.sh: " in r.stderr, (args, r.stderr)
  r = subprocess.run(["bash", os.path.join(LAUNCH, "multinode.sh"), "h:1", "2", "1", "--", "sh", "-c", "exit 7"],
                     capture_output=True, text=True, timeout=10)
  assert r.returncode == 7


def test_tpu_vm_sh_runs_the_same_command_on_every_worker():
  """--dry-run: one gcloud ssh to every worker, whose command sets up .venv-tpu and runs the arguments unchanged
  (spaces and quotes survive both shells); bad usage is one sentence and status 2."""
  import shlex
  args = ["jetspec-jax", "train", "--config", "configs/qwen3_8b.py", "--config.output_dir=runs/a b'c"]
  r = subprocess.run(["bash", os.path.join(LAUNCH, "tpu_vm.sh"), "--zone", "us-east5-a", "--python", "/opt/py 3.12",
                      "--dry-run", "my-v5p-16", "--", *args], capture_output=True, text=True, timeout=10)
  assert r.returncode == 0, r.stderr
  gcloud = shlex.split(r.stdout)
  assert gcloud[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p-16"], gcloud
  assert "--worker=all" in gcloud and "--zone=us-east5-a" in gcloud
  remote = shlex.split(next(a for a in gcloud if a.startswith("--command="))[len("--command="):])
  assert remote[:3] == ["cd", "jetspec-jax", "&&"] and "PYTHON=/opt/py 3.12" in remote, remote
  assert remote[remote.index("scripts/setup_tpu.sh") + 2:] == [".venv-tpu/bin/" + args[0], *args[1:]], remote
  for bad in (["BAD", "--", "x"], ["name", "--"], ["--zone"], ["name", "x"], ["--bogus", "n", "--", "x"]):
    r = subprocess.run(["bash", os.path.join(LAUNCH, "tpu_vm.sh"), *bad], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and r.stderr.startswith("tpu_vm.sh: "), (bad, r.stderr)

