"""Launching training on Slurm (docs/slurm.md).

settings        the `launcher` group (conf/launcher/slurm.yaml), typed and checked
job             what both paths do before submitting: check the config, fix run_dir, make the run resumable
sbatch          the script scripts/slurm/make_sbatch.py writes (srun train.py, requeue on exit code 4)
submitit_slurm  the Hydra launcher behind `hydra/launcher=slurm` (hydra-submitit-launcher + preemption/requeue)

Nothing here imports torch.
"""
