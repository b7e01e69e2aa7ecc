"""Export a trained policy from a run's orbax checkpoints to a Hugging Face directory.

    python -m launch.export_hf --config=configs/cpu_demo.py --checkpoint=runs/cpu_demo/checkpoints --out=/tmp/policy

The result loads with ``transformers.AutoModelForCausalLM.from_pretrained`` (config, generation config,
safetensors, tokenizer and chat template); a LoRA policy is merged, or with ``--peft`` written as a PEFT adapter
directory for ``peft.PeftModel.from_pretrained(base_model, out)``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from launch.common import run, run_main

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "The run's orbax checkpoint directory.")
_OUT = flags.DEFINE_string("out", None, "Output Hugging Face directory: new or empty (or an earlier export, with "
                           "--overwrite); the base model's directory is refused.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an earlier export of this tool in --out.")
_PEFT = flags.DEFINE_bool("peft", False, "LoRA runs: write a PEFT adapter directory (peft.PeftModel.from_pretrained) "
                          "instead of the merged full weights.")


@run_main
def main(argv: list[str]) -> None:
    del argv
    from agentgym_jax.errors import CheckpointError
    from agentgym_jax import distributed
    from agentgym_jax.trainer import Trainer

    checkpoint = Path(_CHECKPOINT.value)
    if not checkpoint.is_dir():
        raise CheckpointError(f"--checkpoint={checkpoint} is not a directory of orbax checkpoints")
    config = _CONFIG.value
    with config.unlocked():
        config.train.tensorboard = False
        config.env.num_workers = 0
    out = Path(_OUT.value)
    with tempfile.TemporaryDirectory(prefix="agentgym-export-") as scratch:  # the Trainer's logs; removed after
        trainer = Trainer(config, workdir=scratch, checkpoint_dir=checkpoint)
        try:
            if not trainer.maybe_resume():
                raise CheckpointError(f"no checkpoint found in {checkpoint}")
            skipped = trainer.checkpointer.skipped
            note = f" (newer checkpoints {skipped} could not be restored)" if skipped else ""
            if distributed.is_main():  # process 0 writes the export, from its own replica of the parameters
                written = trainer.export(out, overwrite=_OVERWRITE.value, adapter_only=_PEFT.value)
                print(f"exported step {trainer.step}{note} to {written}")
        finally:
            trainer.close()


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "checkpoint", "out"])
    run(main)
