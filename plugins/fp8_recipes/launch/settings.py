"""The `launcher` group (conf/launcher/slurm.yaml) as a typed, checked value, shared by both ways to run on Slurm.

    settings = LauncherSettings.from_cfg(cfg.launcher)   # ValueError "launcher.<key>: <problem> (<fix>)"
    settings.sbatch_options()                            # {"nodes": 1, "ntasks-per-node": 2, "signal": "USR1@120", ...}

scripts/slurm/make_sbatch.py writes these options as ``#SBATCH`` lines; the submitit launcher
(launch/submitit_slurm.py) passes the same settings to submitit. Neither imports torch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from fp8_recipes.checks import check_keys, did_you_mean

__all__ = ["LauncherSettings", "SIGNALS", "MANAGED_SBATCH_OPTIONS", "sbatch_refusal"]

SIGNALS = ("USR1",)
"""Signals scripts/train.py turns into checkpoint + exit 4 that are not Slurm ending the job (SIGTERM is: scancel,
time limit, Slurm's own preemption; a run stopped by SIGTERM is never requeued by us)."""

MANAGED_SBATCH_OPTIONS = {
    "nodes": "nodes", "ntasks-per-node": "tasks_per_node", "gpus-per-node": "gpus_per_node",
    "cpus-per-task": "cpus_per_task", "mem": "mem_gb", "time": "time_min", "partition": "partition",
    "account": "account", "qos": "qos", "job-name": "job_name", "signal": "signal", "requeue": "requeue",
    "no-requeue": "requeue", "output": "(the run directory)", "error": "(the run directory)",
    "open-mode": "(always append)"}
"""sbatch options that a launcher key sets: in launcher.sbatch_args they would contradict it."""

_WORD = re.compile(r"^[A-Za-z0-9_.,:@+%=-]+$")  # a partition, account, QOS or job name: no spaces or shell syntax

# What sbatch says when it refuses a job (Slurm 22.05+) -> the launcher key that asked for it, and the fix. The
# first match wins: "Memory specification can not be satisfied" comes with "Requested node configuration ...",
# "Invalid account or account/partition combination" names a partition too.
_REFUSALS = (
    ("policy", "qos", "ask for what {key} allows (sacctmgr show qos), or choose another QOS or account"),
    ("account", "account", "set {key} to an account of yours (sacctmgr show assoc user=$USER), or null"),
    ("qos", "qos", "set {key} to a QOS your account may use (sacctmgr show assoc user=$USER), or null"),
    ("partition", "partition", "set {key} to a partition of this cluster (sinfo -s lists them), or null"),
    ("node count", "nodes", "lower {key} to the nodes the partition has (sinfo -s), or choose another partition"),
    ("memory", "mem_gb", "lower {key}, or null for the partition's default"),
    ("more processors", "tasks_per_node", "lower {key} x cpus_per_task to the CPUs a node has (sinfo -o %c)"),
    ("gres", "gpus_per_node", "set {key} to the GPUs a node has (sinfo -o %G), or null for a CPU job"),
    ("time limit", "time_min", "lower {key} to the partition's limit (sinfo -o %l)"),
    ("unrecognized option", "sbatch_args", "remove the option from {key}, or fix its name (sbatch --help)"),
    ("feature", "sbatch_args", "give {key} a constraint the nodes have (sinfo -o %f)"),
)


def sbatch_refusal(stderr: str, keys: Mapping[str, str] | None = None) -> str:
    """One line for a job sbatch refused: ``<the launcher key that asked>: sbatch refused the job: <what sbatch
    said>; <the fix>``. ``keys``: settings given under another key (see :meth:`LauncherSettings.validate`)."""
    said = [line.strip().removeprefix("sbatch: ").removeprefix("error: ").removeprefix("Batch job submission failed: ")
            for line in stderr.splitlines() if line.strip() and not line.startswith("Try ")]
    text = "; ".join(said)[:300] or "no reason given"
    field, fix = next(((f, fix) for word, f, fix in _REFUSALS if word in text.lower()),
                      ("", "check {key}.partition, account, qos, time_min and the resources it asks for"))
    key = _key(keys, field) if field else "launcher"
    return f"{key}: sbatch refused the job: {text}; {fix.format(key=key)}"


def _key(keys: Mapping[str, str] | None, field: str) -> str:
    """The key the user gave setting ``field`` as: ``launcher.<field>`` unless ``keys`` names another."""
    return (keys or {}).get(field, f"launcher.{field}")


def _int_at_least(key: str, value: Any, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        fix = f"set {key}=<integer >= {low}>" + (" or null" if optional else "")
        raise ValueError(f"{key}: {value!r} is not an integer >= {low} ({fix})")


def _name(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not _WORD.match(value)):
        raise ValueError(f"{key}: {value!r} is not a Slurm name (use letters, digits, - _ . ; or null)")


def _strings(key: str, value: Any, example: str) -> None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}: {value!r} is not a list of strings (e.g. {key}='[{example}]')")


@dataclasses.dataclass(frozen=True)
class LauncherSettings:
    """One Slurm job's resources, time, preemption and requeue settings; field docs are in conf/launcher/slurm.yaml."""

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None
    signal: str | None = "USR1"
    signal_lead_s: int = 120
    requeue: bool = True
    max_requeues: int = 3
    sbatch_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    srun_args: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()

    @classmethod
    def from_cfg(cls, cfg: Any, keys: Mapping[str, str] | None = None) -> "LauncherSettings":
        """From the composed `launcher` node (DictConfig or dict); every problem is one ValueError naming the key
        (``keys``: see :meth:`validate`)."""
        if cfg is None:
            raise ValueError("launcher: no launcher settings (add the group: launcher=slurm, conf/launcher/slurm.yaml)")
        if not isinstance(cfg, dict):
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        fields = {f.name for f in dataclasses.fields(cls)}
        check_keys("launcher", cfg, fields)
        values = dict(cfg)
        if values.get("sbatch_args") is None:  # (null in the YAML, so that launcher.sbatch_args={...} can set it)
            values["sbatch_args"] = {}
        for key in ("srun_args", "setup"):
            if key in values:
                _strings(f"launcher.{key}", values[key],
                         "--cpu-bind=none" if key == "srun_args" else "export OMP_NUM_THREADS=1")
                values[key] = tuple(values[key])
        settings = cls(**values)
        settings.validate(keys)
        return settings

    def validate(self, keys: Mapping[str, str] | None = None) -> None:
        """A ValueError naming the key of the first bad value. ``keys`` maps a field the user gave under another key
        (the submitit launcher's ``hydra.launcher.nodes``, say) to that key, so that the line names what they wrote."""
        for field in ("nodes", "tasks_per_node", "time_min", "signal_lead_s"):
            _int_at_least(_key(keys, field), getattr(self, field), 1)
        for field in ("gpus_per_node", "cpus_per_task", "mem_gb"):
            _int_at_least(_key(keys, field), getattr(self, field), 1, optional=True)
        _int_at_least("launcher.max_requeues", self.max_requeues, 0)
        for field in ("partition", "account", "qos", "job_name"):
            _name(_key(keys, field), getattr(self, field))
        if self.signal is not None and self.signal not in SIGNALS:
            raise ValueError(f"launcher.signal: {self.signal!r} is not one of {' | '.join(SIGNALS)} | null"
                             f"{did_you_mean(str(self.signal).removeprefix('SIG'), SIGNALS)} (scripts/train.py "
                             f"checkpoints on SIGUSR1; SIGTERM means Slurm is ending the job)")
        if self.signal is not None and self.signal_lead_s >= self.time_min * 60:
            raise ValueError(f"{_key(keys, 'signal_lead_s')}: {self.signal_lead_s} s is not shorter than "
                             f"{_key(keys, 'time_min')}={self.time_min} min (lower signal_lead_s or raise time_min)")
        if not isinstance(self.requeue, bool):
            raise ValueError(f"launcher.requeue: {self.requeue!r} is not true or false (set launcher.requeue=true)")
        if not isinstance(self.sbatch_args, Mapping):
            raise ValueError(f"launcher.sbatch_args: {self.sbatch_args!r} is not a mapping "
                             f"(e.g. launcher.sbatch_args='{{constraint: h200}}')")
        for option, value in self.sbatch_args.items():
            name = str(option).lstrip("-").replace("_", "-")
            if name in MANAGED_SBATCH_OPTIONS:
                raise ValueError(f"launcher.sbatch_args.{option}: set by launcher.{MANAGED_SBATCH_OPTIONS[name]} "
                                 f"(remove it from sbatch_args)")
            if value is None or value is False or isinstance(value, (dict, list)) or "\n" in str(value):
                raise ValueError(f"launcher.sbatch_args.{option}: {value!r} is not one sbatch value "
                                 f"(a string, a number or true; leave the option out for false)")

    def for_trainer(self, trainer: Any) -> "LauncherSettings":
        """These settings for a job of ``trainer`` (its config group): a GPU per task when the trainer runs on GPUs
        (``trainer.device: gpu``, as trainer=gpu sets it) and launcher.gpus_per_node is null."""
        device = trainer.get("device") if hasattr(trainer, "get") else getattr(trainer, "device", None)
        if self.gpus_per_node is None and device == "gpu":
            return dataclasses.replace(self, gpus_per_node=self.tasks_per_node)
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def signal_option(self) -> str | None:
        """sbatch's ``--signal`` value: to the job steps (no ``B:``), where every training process handles it."""
        return None if self.signal is None else f"{self.signal}@{self.signal_lead_s}"

    def sbatch_options(self, default_job_name: str) -> dict[str, Any]:
        """sbatch options (long names without ``--``; True = a flag) for one training job, extra ones last."""
        options: dict[str, Any] = {"job-name": self.job_name or default_job_name, "nodes": self.nodes,
                                   "ntasks-per-node": self.tasks_per_node}
        optional = {"gpus-per-node": self.gpus_per_node, "cpus-per-task": self.cpus_per_task,
                    "mem": f"{self.mem_gb}G" if self.mem_gb else None, "partition": self.partition,
                    "account": self.account, "qos": self.qos}
        options.update({k: v for k, v in optional.items() if v is not None})
        options["time"] = self.time_min
        if self.signal_option:
            options["signal"] = self.signal_option
        options["requeue" if self.requeue else "no-requeue"] = True
        options.update({str(k).lstrip("-").replace("_", "-"): v for k, v in self.sbatch_args.items()})
        return options
