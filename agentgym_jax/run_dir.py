"""A run directory that knows which run it holds: never mixed with another run, never silently replaced.

``launch.train`` claims its ``--workdir`` before anything is loaded. A directory is either

* new or holding no run artifacts: the run is recorded in ``run.json`` (config, code version, start time);
* holding a run: ``--resume`` continues it if the config matches (``train.*``, ``eval.*`` and where the env
  runs, ``env.remote``/workers/timeout, may change, e.g. more steps; the rest must be equal), ``--overwrite``
  deletes the artifacts recorded runs created and starts afresh, and anything else is refused with what to do.

Files are written atomically (a temporary sibling, then a rename), so a kill leaves the old or the new version.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import ml_collections

from agentgym_jax.errors import ConfigError

MANIFEST = "run.json"
# What a training run writes into its directory (everything ``--overwrite`` may delete, nothing else).
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "trajectories.jsonl", "tensorboard", "eval_before.json",
                 "eval_before.md", "eval_before.trajectories.jsonl", "eval_after.json", "eval_after.md",
                 "eval_after.trajectories.jsonl", "report.json", "training.png", "export", "rollouts", MANIFEST)
# Sections a resumed run may change: when to stop, log and evaluate, not what is learned.
RESUMABLE_CHANGES = ("train.steps", "train.progress_bars", "train.tensorboard", "train.report_path",
                     "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints", "train.export_final",
                     "train.workdir", "eval.", "env.remote", "env.num_workers", "env.step_timeout_s")


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Writes ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def code_version() -> str:
    """The git commit of this checkout (with ``+dirty`` when it has local changes), or ``"unknown"``."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def config_differences(recorded: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """Keys (``section.key``) whose values differ between two config dicts, sorted."""
    old, new = _flatten(json.loads(json.dumps(recorded))), _flatten(json.loads(json.dumps(config)))
    return sorted(key for key in set(old) | set(new) if old.get(key, "<absent>") != new.get(key, "<absent>"))


def _check_writable(workdir: Path) -> None:
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"run directory {workdir} is a file, not a directory; pass another --workdir")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(prefix=".write-check.", dir=workdir)
        probe.close()
    except OSError as error:
        raise ConfigError(f"run directory {workdir} is not writable ({error.strerror or error}); pass a writable "
                          "--workdir") from error


def _existing_artifacts(workdir: Path) -> list[str]:
    return [name for name in RUN_ARTIFACTS if (workdir / name).exists()]


def claim_run_directory(workdir: str | Path, config: ml_collections.ConfigDict, resume: bool = False,
                        overwrite: bool = False) -> dict[str, Any]:
    """Makes ``workdir`` this run's directory (see the module docstring); returns the manifest written."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other; pass one of them")
    workdir = Path(workdir)
    _check_writable(workdir)
    manifest_path = workdir / MANIFEST
    manifest: dict[str, Any] | None = None
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{manifest_path} is not valid JSON ({error}); it records which run the directory "
                              "holds: restore it, or start the run in a new --workdir") from error
    artifacts = _existing_artifacts(workdir)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    current = json.loads(config.to_json_best_effort())
    if artifacts and resume:
        if manifest is None:
            raise ConfigError(f"{workdir} holds run files ({', '.join(artifacts)}) but no {MANIFEST}, so it cannot "
                              "be checked that they belong to this config; resume is refused. Start a new run "
                              "with another --workdir")
        changed = [key for key in config_differences(manifest["config"], current)
                   if not key.startswith(RESUMABLE_CHANGES)]
        if changed:
            raise ConfigError(f"--resume with a config that differs from the run's in {changed}; resume with the "
                              f"config recorded in {manifest_path}, or start a new run with another --workdir")
        version = code_version()
        manifest.setdefault("resumes", []).append({"time": now, "code_version": version})
        manifest["config"] = current
        atomic_write_text(manifest_path, json.dumps(manifest, indent=2, default=str) + "\n")
        return manifest
    if artifacts and not overwrite:
        started = f" (started {manifest.get('started', '?')})" if manifest else ""
        raise ConfigError(f"{workdir} already holds a run{started}: {', '.join(artifacts)}. Pass --resume to "
                          "continue it, --workdir=<new directory> for a new run, or --overwrite to delete that "
                          "run's files and start again")
    if artifacts and overwrite:
        if manifest is None:
            raise ConfigError(f"{workdir} holds run files ({', '.join(artifacts)}) but no {MANIFEST}, so nothing "
                              "shows this tool created them; --overwrite refuses to delete them. Move them away or "
                              "pass another --workdir")
        for name in artifacts:
            target = workdir / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    manifest = {"started": now, "code_version": code_version(), "config": current}
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2, default=str) + "\n")
    return manifest
