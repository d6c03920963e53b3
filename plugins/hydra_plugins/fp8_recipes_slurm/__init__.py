"""Hydra launcher plugin ``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml): scripts/train.py on Slurm through
submitit, with preemption -> checkpoint -> requeue -> resume. The behaviour lives in
fp8_recipes.launch.submitit_slurm; Hydra instantiates launchers only from modules under ``hydra_plugins``, and
imports every such module when it scans for plugins, so this one stays a cheap import (no torch, no submitit).
"""

from fp8_recipes.launch.submitit_slurm import TrainingSlurmLauncher


class SlurmLauncher(TrainingSlurmLauncher):
    """``_target_`` of conf/hydra/launcher/slurm.yaml."""
