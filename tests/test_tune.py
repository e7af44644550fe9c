"""``tidegate tune``: the log split by time, a short fine-tuning of the shipped policy, the verdict on the
held-out part, resuming, and bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tidegate.engine.cli import main
from tidegate.engine.workloads.registry import resolve_trace
from tidegate.engine.workloads.traces import read_trace, write_trace
from tidegate.training.errors import ConfigError
from tidegate.training.tune import TuneSettings, latest_checkpoint, num_timesteps, split_trace, tune

pytestmark = pytest.mark.timeout(300)

#: one rollout of fine-tuning (a checkpoint every 512 timesteps) and small evaluation cells: the stages,
#: not the policy's quality
SHORT = {"save_freq": 512}


def test_a_written_trace_reads_back_the_same(tmp_path):
    arrivals = read_trace(resolve_trace("splitwise_code"), first_n=300)
    assert read_trace(write_trace(arrivals, tmp_path / "log.csv")) == arrivals


def test_the_log_splits_by_time_into_two_traces(tmp_path):
    train_csv, held_csv, n_train, n_held = split_trace(resolve_trace("splitwise_code"), 0.25, tmp_path)
    first, rest = read_trace(train_csv), read_trace(held_csv)
    full = read_trace(resolve_trace("splitwise_code"))
    assert (len(first), len(rest)) == (n_train, n_held) and n_train + n_held == len(full)
    span = full[-1].arrival_time_s
    assert first[-1].arrival_time_s < 0.25 * span <= full[n_train].arrival_time_s
    assert rest[0].arrival_time_s == 0.0  # re-based
    with pytest.raises(ConfigError, match="at least"):
        split_trace(resolve_trace("splitwise_code"), 0.001, tmp_path)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    settings = TuneSettings(trace=resolve_trace("splitwise_code"), out=out, timesteps=512, minutes=5, loads=(1.2,),
                            seeds=(0,), requests=150, backend="serial", overrides=SHORT)
    lines: list[str] = []
    return settings, tune(settings, say=lines.append), lines


def test_tune_runs_every_stage_and_its_verdict_follows_the_figures(tuned):
    settings, verdict, lines = tuned
    out = settings.out
    stages = [line[:3] for line in lines]
    assert sorted(set(stages)) == ["1/4", "2/4", "3/4", "4/4"] and stages == sorted(stages)
    for name in ("train.csv", "heldout.csv", "train/model.zip", "candidate.onnx", "evaluation/matrix.json",
                 "tune.md", "tune.json", "tune.png"):
        assert (out / name).exists(), name
    # fine-tuned from the shipped model: it carries on from the shipped model's timesteps
    assert num_timesteps(out / "train" / "model.zip") > num_timesteps(settings.base_model)
    (cell,) = verdict["cells"]
    # one draw: no standard error, a margin above 0 is needed over both
    beats = cell["tuned"] > max(cell["shipped"], cell["prior"])
    assert cell["margin_shipped"]["se"] is None
    assert verdict["shipped"] is beats
    assert (out / "policy.onnx").exists() is beats
    assert ("**Shipped**" if beats else "**Not shipped**") in (out / "tune.md").read_text()
    assert json.loads((out / "tune.json").read_text())["shipped"] is beats


def test_resume_skips_the_stages_done(tuned):
    settings, verdict, _ = tuned
    model = settings.out / "train" / "model.zip"
    before = model.stat().st_mtime_ns
    lines: list[str] = []
    again = tune(TuneSettings(**{**settings.__dict__, "resume": True}), say=lines.append)
    assert model.stat().st_mtime_ns == before  # not trained again
    assert again["cells"] == verdict["cells"]
    assert not any("fine-tuning" in line for line in lines)


def test_a_margin_ships_only_above_its_standard_error():
    from tidegate.training.tune import beats, paired_margin

    steady = paired_margin([1.02, 1.03, 1.01, 1.02], [1.0, 1.0, 1.0, 1.0])
    assert steady["mean"] == pytest.approx(0.02) and beats(steady)
    noisy = paired_margin([1.10, 0.93, 1.05, 0.96], [1.0, 1.0, 1.0, 1.0])
    assert noisy["mean"] > 0 and not beats(noisy)
    assert not beats(paired_margin([0.99], [1.0])) and beats(paired_margin([1.01], [1.0]))


def test_an_interrupted_tune_resumes_from_its_latest_whole_checkpoint(tuned, tmp_path):
    import shutil

    settings, verdict, _ = tuned
    out = tmp_path / "tune"
    shutil.copytree(settings.out, out)
    base = num_timesteps(settings.base_model)
    saved = sorted((out / "train").glob("ppo_serving_*_steps.zip"))
    assert saved, "the fine-tuning saved no checkpoint"
    # interrupted after its last checkpoint, before the stage was recorded: model.zip never written
    state = json.loads((out / "tune_state.json").read_text())
    for stage in ("trained", "exported", "evaluated"):
        state.pop(stage)
    (out / "tune_state.json").write_text(json.dumps(state))
    (out / "train" / "model.zip").unlink()
    newest = latest_checkpoint(out / "train", base + 1)
    # a checkpoint whose statistics were not written is passed over
    steps = num_timesteps(newest)
    (out / "train" / f"ppo_serving_vecnormalize_{steps}_steps.pkl").rename(out / "stats.pkl")
    assert latest_checkpoint(out / "train", base + 1) != newest
    (out / "stats.pkl").rename(out / "train" / f"ppo_serving_vecnormalize_{steps}_steps.pkl")
    lines: list[str] = []
    again = tune(TuneSettings(**{**settings.__dict__, "out": out, "resume": True}), say=lines.append)
    assert any("had ended" in line and newest.name in line for line in lines)
    assert num_timesteps(out / "train" / "model.zip") == steps
    # evaluated again (the checkpoint was saved before the run's last update, so its figures may differ)
    assert [c["load"] for c in again["cells"]] == [c["load"] for c in verdict["cells"]]
    assert (out / "policy.onnx").exists() is again["shipped"]
    # other settings cannot resume this folder
    with pytest.raises(ConfigError, match="other settings"):
        tune(TuneSettings(**{**settings.__dict__, "out": out, "resume": True, "split": 0.6}))


def test_bad_input_gets_one_sentence_and_exit_code_2(tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["tune", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "o")])
    assert out.exit_code == 2 and "cannot be read" in out.output and "Traceback" not in out.output
    out = runner.invoke(main, ["tune", "splitwise_code", "--split", "1.5", "--out", str(tmp_path / "o")])
    assert out.exit_code == 2 and "--split" in out.output
    out = runner.invoke(main, ["tune", "splitwise_code", "--profile", "no-such-profile", "--out", str(tmp_path / "o")])
    assert out.exit_code == 2 and "--profile" in out.output
    out = runner.invoke(main, ["tune", "splitwise_code", "--loads", "1.2,x", "--out", str(tmp_path / "o")])
    assert out.exit_code == 2 and "--loads" in out.output


def test_the_learned_controller_takes_its_policy_file_as_policy_or_path():
    from tidegate.ctrl import ControllerSpecError, build_controller
    from tidegate.ctrl.learned import DEFAULT_POLICY
    from tidegate.engine.core.profile import load_profile

    profile = load_profile("a100-llama2-7b")
    assert build_controller(f"learned:policy={DEFAULT_POLICY}", profile) is not None
    with pytest.raises(ControllerSpecError, match="once"):
        build_controller(f"learned:policy={DEFAULT_POLICY},path={DEFAULT_POLICY}", profile)
