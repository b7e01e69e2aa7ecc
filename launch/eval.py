"""Evaluate a policy on the test split: Avg@k and Pass@k, overall and per subtask.

    python -m launch.eval --config=configs/cpu_demo.py --checkpoint=runs/cpu_demo/checkpoints
    python -m launch.eval --config=configs/babyai_grpo.py --checkpoint=runs/cpu_demo/export --k=4 --greedy=false

``--checkpoint`` is a run's orbax checkpoint directory (the newest readable checkpoint is used) or an exported
Hugging Face directory. Writes ``<out>/eval.json``, ``<out>/eval.md`` and the trajectories.
"""

from __future__ import annotations

from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from launch.common import run, run_main

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Orbax checkpoint directory or Hugging Face directory.")
_OUT = flags.DEFINE_string("out", None, "Output directory (default: next to the checkpoint).")
_K = flags.DEFINE_integer("k", None, "Samples per task (default: config.eval.k).")
_GREEDY = flags.DEFINE_bool("greedy", None, "Greedy decoding (default: config.eval.greedy).")
_SPLIT = flags.DEFINE_enum("split", "test", ["test", "validation"], "Which tasks to evaluate.")


@run_main
def main(argv: list[str]) -> None:
    del argv
    from agentgym_jax.errors import CheckpointError
    from agentgym_jax.trainer import Trainer, _write_eval
    from agentgym_jax import distributed, evaluation

    config = _CONFIG.value
    checkpoint = Path(_CHECKPOINT.value)
    if not checkpoint.exists():
        raise CheckpointError(f"--checkpoint={checkpoint} does not exist")
    is_hf = (checkpoint / "config.json").is_file()
    out = Path(_OUT.value or (checkpoint / "eval" if is_hf else checkpoint.parent / "eval"))
    with config.unlocked():
        if is_hf:
            config.model.path = str(checkpoint)
        config.train.tensorboard = False
    trainer = Trainer(config, workdir=out, checkpoint_dir=None if is_hf else checkpoint)
    try:
        if not is_hf and not trainer.maybe_resume():
            raise CheckpointError(f"no checkpoint found in {checkpoint}")
        if not is_hf:
            skipped = trainer.checkpointer.skipped
            print(f"evaluating checkpoint step {trainer.step}" + (
                f" (newer checkpoints {skipped} could not be restored and were skipped)" if skipped else ""))
        tasks = trainer.test_tasks if _SPLIT.value == "test" else trainer.validation_tasks
        summary, trajectories = trainer.evaluate(tasks, k=_K.value, greedy=_GREEDY.value, desc=f"{_SPLIT.value} eval")
        if not distributed.is_main():  # every process played its share; process 0 writes the results
            return
        _write_eval(out / "eval", summary, trajectories)
        if trainer.recorder is not None:  # --config.train.record_rollouts=True: every episode, for analysis
            trainer.recorder.write(f"eval_{_SPLIT.value}", trainer.step, trajectories)
        print(evaluation.markdown_table(summary))
        print(f"written to {out}/eval.json and {out}/eval.md")
    finally:
        trainer.close()


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "checkpoint"])
    run(main)
