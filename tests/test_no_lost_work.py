"""No lost or mixed work: run directories, resumed logs, exports, checkpoints on a full disk, clear launcher errors."""

from __future__ import annotations

import errno
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym_jax.errors import CheckpointError, ConfigError
from agentgym_jax.metrics_log import MetricLogger, read_metrics
from agentgym_jax.run_dir import claim_run_directory
from tests.test_trainer import tiny_config
from tests.tiny_models import save_tiny_chat_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


# -- run directories ---------------------------------------------------------------------------------


def test_a_second_run_in_a_used_directory_is_refused_and_the_first_kept(tiny_dir, tmp_path):
    from agentgym_jax.trainer import train_and_evaluate

    config = tiny_config(tiny_dir, tmp_path, steps=2, checkpoint_every=1, eval_before=False)
    train_and_evaluate(config)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    rows = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run.*--resume.*--workdir.*--overwrite"):
        train_and_evaluate(tiny_config(tiny_dir, tmp_path, steps=3, checkpoint_every=1, eval_before=False))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert (tmp_path / "metrics.jsonl").read_text() == rows
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert manifest["config"]["train"]["steps"] == 2 and manifest["code_version"]


def test_resume_requires_the_same_config_but_may_extend_steps(tiny_dir, tmp_path):
    config = tiny_config(tiny_dir, tmp_path, steps=2)
    claim_run_directory(tmp_path, config)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    changed = tiny_config(tiny_dir, tmp_path, steps=2)
    changed.algo.learning_rate = 1.0
    with pytest.raises(ConfigError, match=r"differs from the run's in \['algo.learning_rate'\]"):
        claim_run_directory(tmp_path, changed, resume=True)
    longer = claim_run_directory(tmp_path, tiny_config(tiny_dir, tmp_path, steps=5), resume=True)
    assert longer["config"]["train"]["steps"] == 5 and len(longer["resumes"]) == 1


def test_overwrite_deletes_only_what_runs_create(tiny_dir, tmp_path):
    config = tiny_config(tiny_dir, tmp_path)
    claim_run_directory(tmp_path, config)
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "notes.txt").write_text("mine")
    claim_run_directory(tmp_path, config, overwrite=True)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "run.json").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("someone else's\n")
    with pytest.raises(ConfigError, match="refuses to delete"):
        claim_run_directory(foreign, config, overwrite=True)
    assert (foreign / "metrics.jsonl").read_text() == "someone else's\n"


def test_unwritable_run_directory_is_named(tiny_dir, tmp_path, monkeypatch):
    config = tiny_config(tiny_dir, tmp_path)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        claim_run_directory(a_file, config)
    import agentgym_jax.run_dir as run_dir

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(run_dir.tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(ConfigError, match="not writable \\(Read-only file system\\)"):
        claim_run_directory(tmp_path / "run", config)


# -- logs on resume ----------------------------------------------------------------------------------


def _event_steps_and_purges(directory: Path) -> tuple[list[int], list[int]]:
    """Steps of scalar events and purge steps (SessionLog START) in TensorBoard files, read without TensorFlow."""
    from tensorboardX.proto import event_pb2

    steps, purges = [], []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset: offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 12 + length + 4
            if event.HasField("summary"):
                steps.append(event.step)
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                purges.append(event.step)
    return steps, purges


def test_rewind_drops_later_rows_and_torn_lines_and_purges_tensorboard(tmp_path):
    logger = MetricLogger(tmp_path)
    for step in (1, 2, 3):
        logger.write(step, {"loss": float(step)})
        logger.write_samples(step, [{"text": f"s{step}"}])
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "loss": 4.')  # torn by a kill
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    resumed = MetricLogger(tmp_path)
    resumed.rewind(2)
    resumed.write(3, {"loss": 30.0})
    resumed.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3] and json.loads(lines[-1])["loss"] == 30.0
    assert [json.loads(x)["step"] for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()] == [1, 2]
    steps, purges = _event_steps_and_purges(tmp_path / "tensorboard")
    assert purges == [3] and steps.count(3) == 2  # TensorBoard drops the first file's step 3 at the purge


def test_resume_after_a_kill_logs_each_step_once_with_the_uninterrupted_values(tiny_dir, tmp_path):
    from agentgym_jax.trainer import Trainer, train_and_evaluate

    straight = train_and_evaluate(tiny_config(tiny_dir, tmp_path / "straight", steps=4, eval_before=False))
    config = tiny_config(tiny_dir, tmp_path / "run", steps=4, checkpoint_every=2, eval_before=False)
    claim_run_directory(tmp_path / "run", config)
    first = Trainer(config)
    try:
        first.fit(steps=3)  # logs steps 1-3 and checkpoints 2 and 3
    finally:
        first.close()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "3")  # as if killed while writing checkpoint 3
    report = train_and_evaluate(tiny_config(tiny_dir, tmp_path / "run", steps=4, checkpoint_every=2,
                                            eval_before=False), resume=True)
    assert report["resumed_from_step"] == 2 and straight["workdir"].endswith("straight")
    resumed = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = read_metrics(tmp_path / "straight")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed, expected):
        assert got["rollout/score"] == want["rollout/score"] and got["train/policy_loss"] == pytest.approx(
            want["train/policy_loss"], rel=1e-6, abs=1e-7)


# -- exports -----------------------------------------------------------------------------------------


def test_export_never_touches_foreign_files_or_the_base_model(tiny_dir, tmp_path):
    from agentgym_jax import hf

    model = hf.load_model(tiny_dir)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_text("my own weights")
    with pytest.raises(CheckpointError, match="not written by an export of this tool"):
        hf.export_model(model, mine, tokenizer_dir=tiny_dir)
    assert (mine / "model.safetensors").read_text() == "my own weights"
    base = sorted((p.name, p.stat().st_size) for p in tiny_dir.iterdir())
    with pytest.raises(CheckpointError, match="would destroy the base model"):
        hf.export_model(model, tiny_dir, tokenizer_dir=tiny_dir, overwrite=True)
    assert sorted((p.name, p.stat().st_size) for p in tiny_dir.iterdir()) == base
    out = hf.export_model(model, tmp_path / "export", tokenizer_dir=tiny_dir)
    with pytest.raises(CheckpointError, match="--overwrite"):
        hf.export_model(model, out, tokenizer_dir=tiny_dir)
    hf.export_model(model, out, tokenizer_dir=tiny_dir, overwrite=True)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]  # no partial or hidden leftovers


# -- model and config errors -------------------------------------------------------------------------


def test_context_length_and_bucket_limits_are_named(tiny_dir, tmp_path):
    from agentgym_jax import hf
    from agentgym_jax.buckets import bucket
    from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
    from agentgym_jax.trainer import Trainer

    model = hf.load_model(tiny_dir)
    limit = model.config.max_position_embeddings
    sampler = Sampler(model, SamplerConfig(cache_length=2 * limit))
    with pytest.raises(ConfigError, match=f"beyond the model's context of {limit} tokens"):
        sampler.generate(sampler.new_state(1), [[5] * (limit + 1)], None, SamplingParams(max_new_tokens=1))
    with pytest.raises(ConfigError, match=f"rollout.max_trajectory_tokens={limit + 1} exceeds the model's context"):
        Trainer(_with_budget(tiny_config(tiny_dir, tmp_path), limit + 1))
    with pytest.raises(ConfigError, match="rollout.max_trajectory_tokens=9000 exceeds the largest shape bucket, 8192"):
        bucket(9000, (4096, 8192), "rollout.max_trajectory_tokens")


def _with_budget(config, tokens):
    config.rollout.max_trajectory_tokens = tokens
    return config


def test_broken_config_json_is_named_not_blamed_on_the_tokenizer(tiny_dir, tmp_path):
    from agentgym_jax.trainer import Trainer

    broken = tmp_path / "model"
    shutil.copytree(tiny_dir, broken)
    (broken / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        Trainer(tiny_config(broken, tmp_path / "run"))


def test_checkpoint_disk_full_is_reported_before_writing(tiny_dir, tmp_path, monkeypatch):
    import agentgym_jax.checkpoint as checkpoint
    from agentgym_jax.trainer import Trainer

    trainer = Trainer(tiny_config(tiny_dir, tmp_path, steps=1))
    try:
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 1000))
        with pytest.raises(CheckpointError, match="not enough disk space for checkpoint 0.*GB are free"):
            trainer.save()
        monkeypatch.undo()

        def full(*args, **kwargs):
            raise RuntimeError("async write failed") from OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(trainer.checkpointer.manager, "save", full)
        with pytest.raises(CheckpointError, match="writing checkpoint 0 .* failed: the disk is full"):
            trainer.save()
    finally:
        monkeypatch.undo()
        trainer.close()


# -- launchers ---------------------------------------------------------------------------------------


def test_launcher_flag_mistakes_are_one_line_errors(tmp_path):
    typo = _run("-m", "launch.train", "--config=configs/cpu_demo.py", "--config.algo.learning_rat=1e-3",
                f"--workdir={tmp_path}")
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    assert typo.stderr.strip().splitlines() == [
        "error: --config.algo.learning_rat: the config has no key 'learning_rat'. "
        'Did you mean "learning_rate" instead of "learning_rat"?']
    missing = _run("-m", "launch.eval", "--config=configs/missing.py", f"--checkpoint={tmp_path}")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "--config: cannot load the config file ([Errno 2] No such file" in missing.stderr


def test_logs_are_quiet_by_default_and_verbosity_brings_info_back():
    program = ("from absl import logging\nfrom launch.common import run\n"
               "run(lambda argv: (logging.info('an info line'), logging.warning('a warning line')))")
    quiet = _run("-c", program)
    assert "a warning line" in quiet.stderr and "an info line" not in quiet.stderr
    verbose = _run("-c", program, "--verbosity=0")
    assert "an info line" in verbose.stderr
