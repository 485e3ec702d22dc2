"""The Slurm recipe of docs/faults.md on a real Slurm: munged, slurmctld and slurmd brought up on localhost (one
node, a slurm.conf of its own in a temp dir, its own ports and munge socket), the docs' sbatch
script submitted (only the GPU request dropped and a tiny float64 CPU run put in its `fived train`),
preempted mid-run the way its `--signal=TERM@120` does (SIGTERM to the job's steps, not to the batch
shell): the first run saves and exits 75, the script requeues the job, Slurm starts it again, it
continues the checkpoint and ends exactly (float64, every loss) where an uninterrupted run ends.
Skipped only where the Slurm packages are missing and CI is unset (CI installs them: .ci/run)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from docs_pages import docs_text

from fived.config import build_config
from fived.testing import run_on_ranks
from fived.training.faults import PREEMPTED_EXIT
from fived.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")
MISSING = [name for name in DAEMONS + CLIENTS if not shutil.which(name) and not os.path.exists(f"/usr/sbin/{name}")]
pytestmark = [
    pytest.mark.skipif(
        bool(MISSING) and not os.environ.get("CI"),
        reason=f"Slurm not installed (no {', '.join(MISSING)}; apt-get install slurmctld "
        "slurmd slurm-client munge; CI installs them and never skips)",
    ),
    pytest.mark.skipif(
        os.geteuid() != 0 and not os.environ.get("CI"),
        reason="the test's Slurm runs its daemons as root (SlurmUser=root)",
    ),
]

# The preemption comes once 60 steps are logged and lands a few steps later (measured at load ~30:
# every rank stopped after step 67); the requeued run then trains the rest, every loss compared.
STEPS = 150
RUN = {
    "train.dtype": "float64",
    "train.steps": STEPS,
    "train.seq_len": 32,
    "train.global_batch": 8,
    "train.log_every": 1000,
}
FIVED = (
    "fived train --model tiny --nproc 2 --dp 2 --steps {steps} --train.dtype float64 --seq-len 32 "
    "--global-batch 8 --train.log_every 1000 --checkpoint.every 50 --train.output_dir {out} --resume auto"
)


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_script(output_dir: Path) -> str:
    """The sbatch script of the Slurm paragraph (docs/faults.md), adapted for this CPU-only machine: no
    `--gpus-per-node`, and a tiny float64 run in place of `--config run.toml ... --nproc 8`."""
    text = docs_text()  # (docs/faults.md has the recipe)
    block = re.search(r"\nSlurm \(one node.*?```bash\n(.*?)```", text, re.S)
    assert block, "the Slurm recipe of docs/faults.md is gone"
    script = block.group(1)
    gpus, command = " --gpus-per-node=8", "fived train --config run.toml --resume auto --max-restarts 3 --nproc 8"
    assert gpus in script and command in script, script
    return script.replace(gpus, "").replace(command, FIVED.format(steps=STEPS, out=output_dir))


class Slurm:
    """munged + slurmctld + slurmd on localhost, run in the foreground as this process's children."""

    def __init__(self, root: Path):
        self.root, self.procs = root, []
        for sub in ("munge", "sock", "state", "spool", "log"):
            (root / sub).mkdir(mode=0o755)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf = root / "slurm.conf"
        self.conf.write_text(f"""\
ClusterName=fivedtest
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits cred_expire + 1 s before it may start again (default 120 s)
AuthInfo=socket={root}/sock/munge,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=1
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=localhost CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "OMP_NUM_THREADS": "1"}

    def start(self) -> None:
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                _exe("munged"),
                "-F",
                f"--key-file={m}/munge.key",
                f"--socket={self.root}/sock/munge",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/seed",
            ],
        )
        self._until((self.root / "sock" / "munge").exists, "munged did not create its socket")
        self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_exe("slurmd"), "-D", "-f", str(self.conf), "-N", "localhost"])
        self._until(
            lambda: self.cmd("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle",
            "the node did not come up idle",
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115  (the daemon's log, for its lifetime)
        self.procs.append(subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT))

    def _until(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"{what} (exited: {dead})\n{self.logs()}"
            time.sleep(0.2)

    def cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([_exe(args[0]), *args[1:]], env=self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 or not check, f"{args}: {done.stderr}\n{self.logs()}"
        return done

    def job(self, job_id: str) -> dict[str, str]:
        text = self.cmd("scontrol", "show", "job", job_id, "--oneliner").stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def logs(self) -> str:
        tails = []
        for path in sorted((self.root / "log").iterdir()) + [self.root / "munge" / "munged.log"]:
            if path.exists():
                tails.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(tails)

    def stop(self) -> None:
        """Cancel what is left of this cluster's jobs, then end the daemons this object started."""
        if self.procs and self.procs[-1].poll() is None:
            self.cmd("scancel", "--full", "--user=root", check=False)
            deadline = time.monotonic() + 20
            while self.cmd("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture(scope="module")
def slurm():
    if MISSING:  # CI set: never skip
        pytest.fail(
            f"Slurm not installed: no {', '.join(MISSING)} (.ci/run installs slurmctld slurmd slurm-client munge)"
        )
    root = Path(tempfile.mkdtemp(prefix="fived-slurm-"))  # (munged wants its socket's folder open to all)
    root.chmod(0o755)
    cluster = Slurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_the_readme_sbatch_script_is_requeued_on_preemption_and_ends_as_without_it(slurm, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "slurm.out"
    script = tmp_path / "job.sh"
    script.write_text(readme_script(run_dir))
    bin_dir = tmp_path / "bin"  # `fived` in the script: this interpreter's fived
    bin_dir.mkdir()
    (bin_dir / "fived").write_text(f'#!/bin/sh\nexec {sys.executable} -m fived "$@"\n')
    (bin_dir / "fived").chmod(0o755)
    slurm.env["PATH"] = f"{bin_dir}:{slurm.env['PATH']}"
    slurm.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    job_id = slurm.cmd("sbatch", "--parsable", f"--output={out}", f"--chdir={tmp_path}", str(script)).stdout.strip()

    deadline = time.monotonic() + 120  # wait for step 60 (a checkpoint every 50 steps) ...
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 60):
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "CONFIGURING", "RUNNING") and time.monotonic() < deadline, (
            f"{state}\n{out.read_text() if out.exists() else ''}\n{slurm.logs()}"
        )
        time.sleep(0.2)
    # ... then preempt it as `#SBATCH --signal=TERM@120` does: SIGTERM to the job's steps (srun's
    # tasks), not to the batch shell, which then runs the requeue line
    slurm.cmd("scancel", "--signal=TERM", job_id)

    deadline = time.monotonic() + 150
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    while (info := slurm.job(job_id))["JobState"] not in ended:
        assert time.monotonic() < deadline, (
            f"{info['JobState']} {info.get('Reason')}\n{out.read_text()}\n{slurm.logs()}"
        )
        time.sleep(0.5)
    log = out.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}\n{slurm.logs()}"
    assert info["Restarts"] == "1", info  # requeued once (by the script: the preemption alone would end it)
    # the first run saved the step it stopped after and exited 75; srun passed 75 on; the script requeued
    saved = re.search(r"preempted \(SIGTERM\): every rank stopped after step (\d+) and saved (\S+);", log)
    assert saved, log
    step = int(saved.group(1))
    assert 60 <= step < STEPS and saved.group(2) == str(run_dir / "checkpoints" / f"step-{step}"), log
    assert f"task 0: Exited with exit code {PREEMPTED_EXIT}" in log, log
    launches = [json.loads(line) for line in (run_dir / "launches.jsonl").read_text().splitlines()]
    assert [r["event"] for r in launches] == ["start", "resume"], launches
    assert launches[1]["resume_from"].rstrip("/").endswith(f"checkpoints/step-{step}"), launches[1]
    assert f"resuming step {step} of {run_dir}" in log, log
    # the requeued run ends exactly where the same run without the preemption ends (float64)
    cfg = build_config(overrides={**RUN, "model.name": "tiny", "parallel.dp": 2})
    whole = run_on_ranks(2, run_training, cfg, False, False, True, timeout_s=300)[0]
    assert _losses(run_dir) == [(m["step"], m["loss"]) for m in whole.metrics]
