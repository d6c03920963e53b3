"""A real, one-node Slurm for the tests: munged, MariaDB + slurmdbd (so that sacct, and with it submitit, sees how
jobs end), slurmctld and slurmd from Debian's packages, every file under one temporary directory.

    cluster = SlurmCluster(tmp_dir, free_port)
    cluster.start()                      # installs missing packages (apt-get, root) under CI or FP8_RECIPES_INSTALL_SLURM=1
    job = cluster.sbatch(script_path)    # -> job id
    info = cluster.wait_until_done(job)  # {"JobState": "COMPLETED", "Restarts": "1", "ExitCode": "0:0", ...}
    cluster.stop()                       # scancel every job, then each daemon by its pid file

Settings are those measured in docs/facts.md ("A real Slurm on the CPU machine"): no cgroups (proctrack/linuxproc,
task/none), munge on its own socket, and ``cred_expire=10`` so that a requeued job restarts within seconds instead of two minutes. Every client finds this
cluster through ``SLURM_CONF`` in :attr:`SlurmCluster.env`. Daemons are stopped by their pid files, never by name:
other Slurm or MariaDB processes on the machine are left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

__all__ = ["SlurmCluster", "SlurmUnavailable", "PACKAGES"]

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server")
BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "scontrol", "munged", "mungekey", "mariadbd",
            "mariadb-install-db")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


class SlurmUnavailable(RuntimeError):
    """Slurm could not be installed or started here; the message says which step failed and how."""


def _run(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def install_packages() -> None:
    """apt-get install the Debian packages when a binary is missing (root and apt needed; about 10 s), only under CI
    (the environment variable CI, which .ci/run sets) or FP8_RECIPES_INSTALL_SLURM=1; elsewhere SlurmUnavailable
    says how, and the Slurm tests skip with that reason."""
    if all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in BINARIES):
        return
    if not (os.environ.get("CI") or os.environ.get("FP8_RECIPES_INSTALL_SLURM") == "1"):
        # installing system packages is CI's business (.ci/run sets CI); on anyone else's machine, only when asked
        raise SlurmUnavailable(f"Slurm is not installed; install {' '.join(PACKAGES)}, or let the tests apt-get "
                               f"install them (root): FP8_RECIPES_INSTALL_SLURM=1")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(f"Slurm is not installed and this is not root with apt-get; install {' '.join(PACKAGES)}")
    print(f"slurm_cluster: apt-get install {' '.join(PACKAGES)} (CI or FP8_RECIPES_INSTALL_SLURM=1)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = _run(cmd, timeout=600, env=env)
    if proc.returncode != 0:  # a fresh machine has no package lists yet
        _run(["apt-get", "update", "-q"], timeout=600, env=env)
        proc = _run(cmd, timeout=600, env=env)
    if proc.returncode != 0:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr.strip()[-500:]}")


def _wait(predicate: Callable[[], bool], what: str, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-1500:] if log is not None and log.exists() else ""
    raise SlurmUnavailable(f"{what} did not come up within {timeout:.0f} s{': ' + tail if tail else ''}")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class SlurmCluster:
    """One node (this host), one partition ``debug``, accounting through slurmdbd; see the module docstring."""

    def __init__(self, root: Path, free_port: Callable[[], int], cpus: int = 8):
        self.root = Path(root)
        self.cpus = cpus
        self.free_port = free_port
        self.host = socket.gethostname()
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.conf = self.root / "etc" / "slurm.conf"
        self.started: list[tuple[str, Path]] = []  # (daemon, pid file), in start order

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF: what every Slurm client (sbatch, scontrol, submitit) needs."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- start ---------------------------------------------------------------------------------------------------

    def start(self) -> "SlurmCluster":
        install_packages()
        for d in ("munge", "etc", "mysql", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        try:
            self._start_munge()
            db_port = self._start_mariadb()
            dbd_port = self._start_slurmdbd(db_port)
            self._start_slurm(dbd_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _daemon(self, name: str, cmd: list[str], pid_file: Path, log: Path, **kw) -> None:
        proc = _run(cmd, timeout=120, **kw)
        if proc.returncode != 0:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise SlurmUnavailable(f"{name} did not start (exit {proc.returncode}): {proc.stderr.strip()[-800:]} {tail}")
        self.started.append((name, pid_file))
        _wait(pid_file.exists, f"{name}'s pid file", 30, log)

    def _start_munge(self) -> None:
        d = self.root / "munge"
        key = d / "munge.key"
        proc = _run(["mungekey", "-c", "-k", str(key)])
        if proc.returncode != 0:
            raise SlurmUnavailable(f"mungekey failed: {proc.stderr.strip()}")
        key.chmod(0o400)
        d.chmod(0o700)
        self._daemon("munged", ["munged", "--force", "-S", str(self.munge_socket), f"--key-file={key}",
                                f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                                f"--seed-file={d / 'munged.seed'}"], d / "munged.pid", d / "munged.log")

    def _start_mariadb(self) -> int:
        data, port = self.root / "mysql", self.free_port()
        proc = _run(["mariadb-install-db", f"--datadir={data}", "--user=root", "--auth-root-authentication-method=normal",
                     "--skip-test-db"], timeout=120)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"mariadb-install-db failed: {proc.stderr.strip()[-800:]}")
        pid, log = self.root / "run" / "mariadb.pid", self.root / "log" / "mariadb.log"
        # mariadbd does not daemonize: started in the background; the pid file is how it is stopped.
        subprocess.Popen(["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root", f"--port={port}",
                          "--bind-address=127.0.0.1", f"--socket={self.root / 'run' / 'mysql.sock'}",
                          f"--pid-file={pid}", f"--log-error={log}", "--skip-grant-tables"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.started.append(("mariadbd", pid))
        _wait(lambda: pid.exists() and _port_open(port), "mariadbd", 60, log)
        return port

    def _start_slurmdbd(self, db_port: int) -> int:
        port = self.free_port()
        conf = self.root / "etc" / "slurmdbd.conf"
        pid, log = self.root / "run" / "slurmdbd.pid", self.root / "log" / "slurmdbd.log"
        conf.write_text("\n".join([
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}", "DbdHost=localhost", f"DbdPort={port}",
            "SlurmUser=root", f"PidFile={pid}", f"LogFile={log}", "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1", f"StoragePort={db_port}", "StorageUser=root", "StorageLoc=slurm_acct_db", ""]))
        conf.chmod(0o600)  # slurmdbd refuses a config others can read (it may hold the DB password)
        # slurmdbd has no -f: it reads slurmdbd.conf beside $SLURM_CONF
        self._daemon("slurmdbd", ["slurmdbd"], pid, log, env=self.env)
        _wait(lambda: _port_open(port), "slurmdbd", 60, log)
        return port

    def _start_slurm(self, dbd_port: int) -> None:
        r = self.root
        # More CPUs than the machine has (slurmd reports the configured ones: config_overrides), so that the tests'
        # 2-task jobs run side by side and their start-up and requeue waits overlap; each task uses one thread.
        cpus = max(os.cpu_count() or 1, self.cpus)
        mem_mb = max(1024, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20) - 1024)
        self.conf.write_text("\n".join([
            "ClusterName=fp8test", f"SlurmctldHost={self.host}",
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",  # requeued jobs restart in seconds (docs/facts.md)
            "SlurmUser=root", "SlurmdUser=root", f"SlurmctldPort={self.free_port()}", f"SlurmdPort={self.free_port()}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=localhost",
            f"AccountingStoragePort={dbd_port}", f"AccountingStoragePass={self.munge_socket}",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
            "MailProg=/bin/true", "EnforcePartLimits=ALL", "KillWait=5", "MinJobAge=600",
            "SlurmdParameters=config_overrides",
            f"NodeName={self.host} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        env = self.env
        self._daemon("slurmctld", ["slurmctld", "-f", str(self.conf)], r / "run" / "slurmctld.pid",
                     r / "log" / "slurmctld.log", env=env)
        self._daemon("slurmd", ["slurmd", "-f", str(self.conf)], r / "run" / "slurmd.pid", r / "log" / "slurmd.log",
                     env=env)
        _wait(lambda: _run(["sinfo", "-h", "-o", "%t"], env=env).stdout.strip() == "idle", "the node (sinfo idle)",
              60, r / "log" / "slurmctld.log")

    # -- jobs ----------------------------------------------------------------------------------------------------

    def sbatch(self, script: Path, *args: str) -> str:
        proc = _run(["sbatch", "--parsable", *args, str(script)], env=self.env)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once Slurm forgot the job."""
        proc = _run(["scontrol", "show", "job", "-o", str(job_id)], env=self.env)
        if proc.returncode != 0:
            return {}
        return dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)

    def wait_until_done(self, job_id: str, timeout: float = 180) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if not info:
                raise RuntimeError(f"Slurm knows no job {job_id!r}")
            if info.get("JobState") in FINISHED:
                return info
            time.sleep(0.25)
        raise TimeoutError(f"job {job_id} not finished after {timeout:.0f} s: {self.job_info(job_id)}")

    def scancel(self, *args: str) -> None:
        _run(["scancel", *args], env=self.env)

    def log(self, name: str) -> str:
        p = self.root / "log" / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    # -- stop ----------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, then stop each daemon by its pid file (reverse start order), waiting for it to exit."""
        if any(name == "slurmctld" for name, _ in self.started):
            jobs = _run(["squeue", "-h", "-o", "%A"], env=self.env).stdout.split()
            if jobs:
                self.scancel(*jobs)
                time.sleep(1)
        for name, pid_file in reversed(self.started):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.started.clear()
