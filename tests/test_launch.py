"""The cluster launchers of scripts/launch (docs/cluster.md).

- slurm.sbatch, DRY_RUN=1 (always runs): the srun + torchrun command it would run for a job's Slurm
  variables (one task per node, c10d rendezvous on the node list's first host, --max-restarts, the out_dir
  and the user's arguments passed on); missing settings are one line and exit code 2.
- slurm.sbatch under a real Slurm (runs where slurmctld and slurmd are installed, skipped elsewhere): the test
  writes a one-machine cluster's slurm.conf to a temporary directory, starts slurmctld and slurmd on free
  ports, submits the script with `sbatch --wait` for one node of 2 CPU workers (gloo), and checks the tiny run
  trained and saved its checkpoint in OUT_DIR.
- k8s-pytorchjob.yaml: parsed and its fields checked (kind, the torchrun command, the elastic policy, GPUs =
  workers per pod, the shared volume that holds out_dir). Not tested: applying it to a cluster (`kubectl apply
  --dry-run=client` needs a reachable API server to know the PyTorchJob kind).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

SBATCH = ROOT / "scripts" / "launch" / "slurm.sbatch"
MANIFEST = ROOT / "scripts" / "launch" / "k8s-pytorchjob.yaml"
JOB_ENV = {"SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1", "SLURM_NNODES": "4", "SLURM_JOB_ID": "4242"}
TINY = ["--config", "gpt-tiny", "--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32",
        "--train.max_steps=2", "--train.micro_batch_size=2", "--train.global_batch_size=4", "--train.eval_iters=1",
        "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false", "--parallel.timeout_s=60"]


def _sbatch_dry(env: dict, *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", str(SBATCH), *args], check=False, capture_output=True, text=True, timeout=30,
                          env={**clean, "DRY_RUN": "1", **env})


def test_slurm_dry_run_prints_one_torchrun_per_node_with_c10d_on_the_first_node():
    proc = _sbatch_dry({**JOB_ENV, "OUT_DIR": "/shared/runs/a b", "SLURM_GPUS_ON_NODE": "8", "MAX_RESTARTS": "2",
                        "MASTER_PORT": "29777"}, "--config", "gpt-small", "--train.max_steps=10")
    assert proc.returncode == 0, proc.stderr
    env_line, command = proc.stdout.splitlines()
    assert env_line == "MASTER_ADDR=gpu07 MASTER_PORT=29777 OMP_NUM_THREADS=1"
    argv = shlex.split(command)
    assert argv[:5] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    launcher = argv[5:argv.index("-m")]
    assert launcher == ["torchrun", "--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d",
                        "--rdzv_endpoint=gpu07:29777", "--rdzv_id=4242", "--max-restarts=2"]
    assert argv[argv.index("-m"):] == ["-m", "meshlm", "train", "--train.out_dir=/shared/runs/a b",
                                       "--train.resume=auto", "--config", "gpt-small", "--train.max_steps=10"]


def test_slurm_dry_run_defaults_and_launcher_override():
    proc = _sbatch_dry({**JOB_ENV, "SLURM_JOB_NODELIST": "n1,n2", "SLURM_NNODES": "2", "OUT_DIR": "/o",
                        "NPROC_PER_NODE": "2", "TORCHRUN": "python -m torch.distributed.run"})
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout.splitlines()[1])
    assert argv[5:10] == ["python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2"]
    assert "--rdzv_endpoint=n1:29500" in argv and "--max-restarts=3" in argv


@pytest.mark.parametrize(("env", "names"), [
    ({}, "OUT_DIR"),
    ({"OUT_DIR": "/o", "MAX_RESTARTS": "many"}, "MAX_RESTARTS"),
    ({"OUT_DIR": "/o", "NPROC_PER_NODE": "0"}, "NPROC_PER_NODE"),
])
def test_slurm_script_refuses_bad_settings_in_one_line(env, names):
    proc = _sbatch_dry({**JOB_ENV, **env})
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and names in proc.stderr, proc.stderr


def test_slurm_script_outside_a_job_says_to_use_sbatch():
    proc = _sbatch_dry({"OUT_DIR": "/o"})
    assert proc.returncode == 2 and "submit with sbatch" in proc.stderr


def test_k8s_manifest_runs_torchrun_elastic_with_out_dir_on_the_shared_volume():
    job, claim = yaml.safe_load_all(MANIFEST.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job["spec"]
    elastic, worker = spec["elasticPolicy"], spec["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert elastic["minReplicas"] == elastic["maxReplicas"] == worker["replicas"]
    assert worker["restartPolicy"] == "OnFailure" and set(spec["pytorchReplicaSpecs"]) == {"Worker"}
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    argv = container["command"] + container["args"]
    assert argv[:4] == ["torchrun", "-m", "meshlm", "train"]
    out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--train.out_dir="))
    assert "--train.resume=auto" in argv
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert int(spec["nprocPerNode"]) == gpus == container["resources"]["requests"]["nvidia.com/gpu"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert out_dir.startswith(mounts["shared"] + "/")
    volume = next(v for v in pod["volumes"] if v["name"] == "shared")
    assert claim["kind"] == "PersistentVolumeClaim"
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every pod reads and writes the checkpoints"
    assert mounts["dshm"] == "/dev/shm"


# ---- a real one-machine Slurm cluster ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(tmp: Path) -> Path:
    host = socket.gethostname()
    conf = tmp / "slurm.conf"
    lines = [
        "ClusterName=meshlmtest", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}", "AuthType=auth/none", "CredType=cred/none",
        f"StateSaveLocation={tmp}/state", f"SlurmdSpoolDir={tmp}/spool", f"SlurmctldPidFile={tmp}/ctld.pid",
        f"SlurmdPidFile={tmp}/d.pid", f"SlurmctldLogFile={tmp}/ctld.log", f"SlurmdLogFile={tmp}/d.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "MpiDefault=none", "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none", "ReturnToService=2",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    (tmp / "state").mkdir(parents=True)
    (tmp / "spool").mkdir()
    conf.write_text("\n".join(lines) + "\n")
    return conf


@pytest.fixture
def slurm_cluster(tmp_path):
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "sinfo") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here ({', '.join(missing)} missing; apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("the one-machine Slurm cluster runs its daemons as root (SlurmUser=root)")
    conf = _slurm_conf(tmp_path / "slurm")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for cmd in (["slurmctld", "-D", "-i", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf)])]
    try:
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], check=False, env=env,
                                           capture_output=True, text=True).stdout:
            if time.monotonic() > deadline:
                pytest.fail("the test's Slurm node did not come up: " + (conf.parent / "ctld.log").read_text()[-2000:])
            time.sleep(0.5)
        yield env
    finally:
        for p in daemons:
            p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _wait_for_job(job: str, env: dict, timeout_s: float = 300) -> str:
    """The job's final state (COMPLETED, FAILED, …) once it has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], check=False, env=env, capture_output=True,
                               text=True).stdout
        state = next((f.split("=", 1)[1] for f in shown.split() if f.startswith("JobState=")), "")
        if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], check=False, env=env, capture_output=True)
    pytest.fail(f"Slurm job {job} did not end within {timeout_s:.0f} s")


def test_sbatch_runs_a_two_worker_job_on_a_one_machine_slurm_cluster(tmp_path, slurm_cluster):
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    env = {**slurm_cluster, "OUT_DIR": str(out), "NPROC_PER_NODE": "2", "MASTER_PORT": str(_free_port()),
           "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    # The script's #SBATCH header asks for 2 GPU nodes: overridden for this one CPU node. Polled here rather
    # than with `sbatch --wait`, whose polling interval grows to 10 s.
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--cpus-per-task={os.cpu_count()}",
                           "--gpus-per-node=0", f"--output={log}", f"--chdir={ROOT}", str(SBATCH), *TINY],
                          check=False, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    state = _wait_for_job(proc.stdout.strip().split(";")[0], env)
    text = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", state + text[-3000:]
    assert "1 node(s) x 2 worker(s)" in text
    assert "layout: 2 processes = pp 1 × dp 2 × tp 1" in text
    assert (out / "checkpoints" / "step_0000002").is_dir(), text[-3000:]
