"""Write an sbatch script that trains with scripts/train.py on Slurm (and submit it with --submit).

    python scripts/slurm/make_sbatch.py +recipe=hybrid                                  # prints the script's path
    python scripts/slurm/make_sbatch.py +recipe=safe trainer=gpu model=llama3_8b_16l launcher.nodes=2 \\
        launcher.tasks_per_node=8 launcher.gpus_per_node=8 launcher.partition=h200 --submit
    python scripts/slurm/make_sbatch.py launcher=mycluster +recipe=tensorwise --output jobs/tw.sbatch

Takes the same Hydra overrides as scripts/train.py; `launcher=NAME` / `launcher.KEY=VALUE` choose and edit the
cluster settings (conf/launcher/slurm.yaml: nodes, tasks and GPUs per node, time, partition, account, signal,
requeue). The config is checked here first (a mistake is one `error:` line, exit 2, nothing written; so is a job
sbatch refuses with --submit: its script and run_dir are removed again). The script goes to `<run_dir>/job.sbatch`
(run_dir fixed now, absolute), Slurm's output to `<run_dir>/slurm-<jobid>.out`; it runs `srun python
scripts/train.py <overrides> trainer.resume=auto run_dir=<run_dir>` and requeues itself after a preemption (exit
code 4), at most launcher.max_requeues times. See docs/slurm.md.
"""

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))  # a checkout without `pip install -e`


def main(argv: list[str]) -> int:
    from fp8_recipes.launch.sbatch import missing_dirs, submit, write_sbatch
    from fp8_recipes.training.errors import USER_ERROR_EXIT, hydra_errors_as_one_line

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for scripts/train.py (+launcher.KEY=VALUE)")
    parser.add_argument("--output", type=Path, help="where to write the script (default: <run_dir>/job.sbatch)")
    parser.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")
    args = parser.parse_args(argv)
    command = "python scripts/slurm/make_sbatch.py " + " ".join(shlex.quote(a) for a in argv)
    try:
        made = missing_dirs(args.output.parent) if args.output else []  # (removed again if sbatch refuses the job)
        with hydra_errors_as_one_line():  # Hydra's own errors (unknown group option, bad override): one line, exit 2
            script, run_dir = write_sbatch(args.overrides, args.output, python=sys.executable,
                                           train_script=ROOT / "scripts" / "train.py", workdir=Path.cwd(),
                                           generated_by=command)
        if args.submit:  # (a refused job's script is removed: its path is printed once sbatch took it)
            job = submit(script, run_dir, made=made)
            print(f"submitted job {job}: output in {run_dir / f'slurm-{job}.out'}", file=sys.stderr)
        print(script)
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
