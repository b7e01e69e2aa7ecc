"""Export a trained policy from a run's orbax checkpoints to a Hugging Face directory.

    python -m launch.export_hf --config=configs/cpu_demo.py --checkpoint=runs/cpu_demo/checkpoints --out=/tmp/policy

The result loads with ``transformers.AutoModelForCausalLM.from_pretrained`` (config, generation config,
safetensors, tokenizer and chat template).
"""

from __future__ import annotations

from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from launch.common import run_main

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "The run's orbax checkpoint directory.")
_OUT = flags.DEFINE_string("out", None, "Output Hugging Face directory.")


@run_main
def main(argv: list[str]) -> None:
    del argv
    from agentgym_jax.errors import CheckpointError
    from agentgym_jax.trainer import Trainer

    checkpoint = Path(_CHECKPOINT.value)
    if not checkpoint.is_dir():
        raise CheckpointError(f"--checkpoint={checkpoint} is not a directory of orbax checkpoints")
    config = _CONFIG.value
    with config.unlocked():
        config.train.tensorboard = False
        config.env.num_workers = 0
    out = Path(_OUT.value)
    trainer = Trainer(config, workdir=out.parent / f".{out.name}.export-run", checkpoint_dir=checkpoint)
    try:
        if not trainer.maybe_resume():
            raise CheckpointError(f"no checkpoint found in {checkpoint}")
        print(f"exported step {trainer.step} to {trainer.export(out)}")
    finally:
        trainer.close()


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "checkpoint", "out"])
    app.run(main)
