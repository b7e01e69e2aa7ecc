"""Learning-curve plot of a run directory: Wilson band, rolling success, held-out points, missing inputs."""

import json
from types import SimpleNamespace

import matplotlib.image
import pytest

from agentgym_jax import evaluation, plots
from agentgym_jax.metrics_log import plot_run as plot_run_from_metrics_log

STEPS = 6


def _eval_summary(successes: list[bool]) -> dict:
    """A real ``evaluation.summarize`` output for one sample (k=1) per task."""
    trajectories = [SimpleNamespace(task_id=i, subtask="goto", success=ok, score=float(ok), turns=3, end_reason="done")
                    for i, ok in enumerate(successes)]
    return evaluation.summarize(trajectories, k=1)


def _fake_run(directory, with_evals: bool = True) -> None:
    with (directory / "metrics.jsonl").open("w") as f:
        for step in range(1, STEPS + 1):
            episodes = 16
            row = {"step": step, "rollout/success": (2 * step) / episodes, "rollout/episodes": episodes,
                   "rollout/score": 0.1 * step, "diag/valid_action_rate": 0.5 + 0.08 * step,
                   "diag/groups_with_signal": 0.1 * step, "diag/abs_advantage": 0.4 - 0.02 * step,
                   "diag/first_abs_logp_gap": 1e-3 * step, "diag/entropy": 1.5 - 0.1 * step,
                   "diag/response_tokens": 40.0 + step}
            if step == 3:
                row.update({"eval/success": 0.4, "eval/score": 0.4})
            f.write(json.dumps(row) + "\n")
    if with_evals:
        (directory / "eval_before.json").write_text(json.dumps(_eval_summary([True] * 8 + [False] * 16)))
        (directory / "eval_after.json").write_text(json.dumps(_eval_summary([True] * 15 + [False] * 9)))


def _assert_png(path) -> None:
    assert path.is_file()
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 400


def test_plot_of_a_full_run(tmp_path):
    _fake_run(tmp_path)
    out = plots.plot_run(tmp_path)
    assert out == tmp_path / "training.png"
    _assert_png(out)


def test_metrics_log_still_exports_plot_run(tmp_path):
    _fake_run(tmp_path, with_evals=False)
    _assert_png(plot_run_from_metrics_log(tmp_path))


def test_empty_metrics_and_no_evals_still_give_a_png(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    _assert_png(plots.plot_run(tmp_path))


def test_missing_metrics_are_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/success": 0.5}) + "\n")
    _assert_png(plots.plot_run(tmp_path))


def test_wilson_band_known_case():
    [(low, high)] = plots.wilson_band([8 / 24], [24])
    # Hand-computed: centre (1/3 + z²/48) / (1 + z²/24) = 0.3563, half-width 0.1766 (z = 1.96).
    assert low == pytest.approx(0.1797, abs=1e-4) and high == pytest.approx(0.5329, abs=1e-4)
    assert plots.wilson_band([0.0, 1.0], [10, 10]) == [(0.0, pytest.approx(0.2775, abs=1e-4)),
                                                       (pytest.approx(0.7225, abs=1e-4), 1.0)]


def test_rolling_success_pools_counts():
    rates, episodes = [0.5, 0.25, 1.0, 0.0, 0.5], [4, 8, 2, 6, 4]  # successes 2, 2, 2, 0, 2
    assert plots.rolling_success(rates, episodes) == [2 / 4, 4 / 12, 6 / 14, 6 / 20, 6 / 20]
    assert plots.rolling_success(rates, episodes, window=2) == [2 / 4, 4 / 12, 4 / 10, 2 / 8, 2 / 10]
    assert plots.rolling_success([0.5, 0.0, 1.0]) == [0.5, 0.25, 0.5]  # no counts: plain mean over the window


def test_held_out_reads_the_real_summary(tmp_path):
    path = tmp_path / "eval_before.json"
    path.write_text(json.dumps(_eval_summary([True] * 8 + [False] * 16)))
    held = plots.load_held_out(path)
    assert held.value == pytest.approx(1 / 3) and held.k == 1 and held.tasks == 24
    assert (held.low, held.high) == evaluation.wilson_interval(8, 24)
    assert plots.load_held_out(tmp_path / "eval_after.json") is None
