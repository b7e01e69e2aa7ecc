"""Train an agent with multi-turn RL.

    python -m launch.train --config=configs/cpu_demo.py
    python -m launch.train --config=configs/babyai_grpo.py:scaling --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.train --config=configs/textcraft_grpo.py --config.algo.advantage_estimator=rloo --resume

A run directory holds one run: a second start in it is refused unless ``--resume`` (continue it, same config) or
``--overwrite`` (delete that run's files first). Logs show warnings only; ``--verbosity=0`` shows INFO lines.

Any config value can be overridden with ``--config.<section>.<key>=<value>``; unknown keys and bad values fail
before anything is loaded or compiled.
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from launch.common import run, run_main

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/<name>.py[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: config.train.workdir).")
_RESUME = flags.DEFINE_bool("resume", False, "Continue the run in the workdir from its newest readable checkpoint.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Delete the files of the run already in the workdir and start "
                               "afresh (without it, a used workdir is refused).")


@run_main
def main(argv: list[str]) -> None:
    del argv
    from agentgym_jax.trainer import train_and_evaluate

    from agentgym_jax import distributed

    report = train_and_evaluate(_CONFIG.value, _WORKDIR.value, resume=_RESUME.value, overwrite=_OVERWRITE.value)
    if not distributed.is_main():  # process 0 reports for the whole run
        return
    lines = [f"run directory: {report['workdir']}"]
    for name in ("before", "after"):
        if f"success_{name}" in report:
            low, high = report[f"wilson_{name}"]
            lines.append(f"test success {name:>6}: {report[f'success_{name}']:.3f} "
                         f"(95% Wilson [{low:.3f}, {high:.3f}], n={report['n_test_tasks']})")
    lines.append(f"minutes: {report['minutes']:.1f}")
    if "export" in report:
        lines.append(f"exported policy: {report['export']}")
    print("\n".join(lines))
    print(json.dumps({k: report[k] for k in report if k.startswith(("success", "wilson"))}))


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    run(main)
