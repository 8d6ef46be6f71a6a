"""The report says how sure its numbers are and what they measure, and advises only what the results support;
its config table is the keys that differ from the defaults; top-1 consistency is plotted on training rounds."""

from __future__ import annotations

from pathlib import Path

from distmoe.io import write_json_atomic
from distmoe.report import plots
from distmoe.report.report import render_markdown, write_report
from distmoe.rundir.metrics import MetricsLog


def _run(root: Path, acc_a_before: float = 0.81, retention: float | None = 0.12, na: bool = False, **config
         ) -> Path:
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "run.json", {
        "run_id": "r", "status": "completed", "warnings": [], "schedule": ["sft:a", "eval", "sft:b", "probe", "eval"],
        "privacy": {"mode": "secagg", "secure_aggregation": True, "eval_noise_sd": 6.364},
        "config": {"eval.max-new-tokens": 10, "privacy.metric-loss-bound": 16.0,
                    "train.lr": 0.001, "model.experts": 4, "run.dir": "/x/run", **config}})
    log = MetricsLog(run_dir / "metrics.jsonl")
    log.append({"event": "run_start", "run_id": "r"})
    log.append({"event": "train", "round": 1, "phase_label": "sft:a", "task": "a", "party": "all",
                "contributors": 3, "parties": 3})
    log.append({"event": "eval", "round": 2, "party": "all", "phase_label": "eval", "acc/a": acc_a_before,
                "n/a": 144.0})
    log.append({"event": "train", "round": 3, "phase_label": "sft:b", "task": "b", "party": "all",
                "contributors": 3, "parties": 3})
    last = {"event": "eval", "round": 4, "party": "all", "phase_label": "eval", "acc/a": 0.0, "n/a": 144.0,
            "loss/a": 9.8, "acc/b": 0.7, "n/b": 144.0, "loss/b": 0.0, "new_task": "b", "new_task_loss": 0.0}
    if retention is not None or na:
        last["retention/a"] = retention  # None (na): undefined, the accuracy before was within its noise
    log.append(last)
    for r, label, top1 in ((1, "sft:a", None), (2, "eval", 1.0), (3, "sft:b", 0.4), (4, "eval", 1.0)):
        log.append({"event": "probe", "round": r, "phase_label": label, "parties": 3, "disagreeing": 0,
                    "anchor_version": 0, "routing_kl": None, "load_cv": 0.5, "top1_consistency": top1,
                    "expert_counts": [[1, 1, 1, 1]]})
    log.append({"event": "run_end", "status": "completed", "rounds": 4})
    return run_dir


def test_retention_against_a_noise_baseline_reads_undefined_and_is_never_called_a_collapse(tmp_path: Path) -> None:
    """The run left retention undefined (``null``: the accuracy before the task was within its noise of 0): the
    report says so, plots nothing for it and names no collapse; a retention whose accuracy now is within its noise
    of 0 reads ``≈ 0 (within noise)``, never ``0.00``."""
    md = write_report(_run(tmp_path / "na", acc_a_before=0.004, retention=None, na=True)).read_text(encoding="utf-8")
    section = md[md.index("## Final evaluation"):md.index("## Routing")]
    assert "| a | ≈ 0 (within noise) | 9.80 ± 0.83 | 144 | n/a (earlier accuracy within noise) |" in section
    assert "Retention collapsed" not in md and "| 0.00 |" not in section
    assert md == render_markdown(tmp_path / "na" / "run")
    md = write_report(_run(tmp_path / "zero", retention=0.0)).read_text(encoding="utf-8")
    assert "| a | ≈ 0 (within noise) | 9.80 ± 0.83 | 144 | ≈ 0 (within noise) |" in md
    assert "**Retention collapsed**: `a` ≈ 0 (within noise)" in md


def test_final_evaluation_says_what_accuracy_measures_and_how_sure_it_is(tmp_path: Path) -> None:
    md = write_report(_run(tmp_path)).read_text(encoding="utf-8")
    assert md == render_markdown(tmp_path / "run")  # what the audit re-renders
    section = md[md.index("## Final evaluation"):md.index("## Routing")]
    assert "at most 10 generated tokens (`eval.max-new-tokens`), matches the reference answer exactly" in section
    assert "| b | 0.70 ± 0.05 |" in section  # 6.364 * sqrt(1 + 0.49) / 144
    assert "| a | ≈ 0 (within noise) | 9.80 ± 0.83 |" in section  # 16 * 6.364 * sqrt(1 + (9.8/16)^2) / 144
    assert "| b | 0.70 ± 0.05 | ≈ 0 (within noise) |" in section  # a clipped 0 is not printed as 0
    assert "New task: `b`, loss ≈ 0 (within noise)." in section
    assert "`± x` is its scale (one standard deviation)" in section


def test_collapse_advice_says_only_what_the_results_support(tmp_path: Path) -> None:
    md = write_report(_run(tmp_path)).read_text(encoding="utf-8")
    assert "**Retention collapsed**: `a` ≈ 0 (within noise)" in md  # `a`'s accuracy now is within its noise of 0
    assert "A larger `routing.anchor-kl-coef` is no remedy: at 5 and 50 the anchor kept +0.005 and +0.009" in md
    assert "holds more of it" not in md  # the old advice no experiment supports
    assert "replaying the earlier task's data kept most of its accuracy (+0.65 against no mechanism" in md
    # which mechanism does what, with the measured numbers
    assert "output distillation (`retention.distill-weight`) kept the most: +0.19 [+0.12, +0.26]" in md
    assert "at −0.13 [−0.19, −0.07] of the new task's accuracy" in md
    assert "keeps routing close to the earlier task's (routing KL 0.11 → 0.011) but did not keep the task" in md
    assert "This run had" not in md  # the run recorded no distillation weight: nothing said about it


def test_collapse_advice_says_whether_this_run_distilled(tmp_path: Path) -> None:
    off = write_report(_run(tmp_path / "off", **{"retention.distill-weight": 0.0})).read_text(encoding="utf-8")
    assert "This run had output distillation off (`retention.distill-weight` = 0): its default, 1, is" in off
    on = write_report(_run(tmp_path / "on", **{"retention.distill-weight": 0.5})).read_text(encoding="utf-8")
    assert "This run had output distillation on (`retention.distill-weight` = 0.5)." in on
    kept = write_report(_run(tmp_path / "kept", retention=0.9, **{"retention.distill-weight": 0.0}))
    assert "This run had" not in kept.read_text(encoding="utf-8")  # no collapse, no advice


def test_config_section_lists_the_changed_keys_and_points_at_config_toml(tmp_path: Path) -> None:
    md = write_report(_run(tmp_path)).read_text(encoding="utf-8")
    section = md[md.index("## Config"):]
    assert "`../config.toml`" in section and "| model.experts | 4 | 8 |" in section
    assert "train.lr" not in section and "run.dir" not in section  # default, and where the run lives
    assert section.count("\n|") == 3  # header, rule, one changed key: not the whole configuration


def test_top1_consistency_is_plotted_on_training_rounds_only(tmp_path: Path, monkeypatch) -> None:
    figs = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.__setitem__(path.name, fig))
    write_report(_run(tmp_path))
    ax = figs["routing.png"].axes[2]
    (line,) = [x for x in ax.lines if x.get_label().startswith("probe")]
    assert list(line.get_xdata()) == [3] and list(line.get_ydata()) == [0.4]  # not the 1.0 of eval rounds 2, 4


def _secure_update_run(root: Path, noised: bool) -> Path:
    """A secure run's released training figures (sft, dpo, rl slot means), with their update-noise stds or not."""
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "run.json", {
        "run_id": "r", "status": "completed", "warnings": [], "schedule": ["sft:a", "dpo:a", "rl:a"],
        "privacy": {"mode": "secagg", "secure_aggregation": True}, "config": {}})
    sd = (lambda **kv: kv) if noised else (lambda **kv: {})
    log = MetricsLog(run_dir / "metrics.jsonl")
    log.append({"event": "train", "round": 1, "phase_label": "sft:a", "task": "a", "party": "all", "contributors": 3,
                "parties": 3, "task_loss": 2.5, **sd(task_loss_sd=0.41)})
    log.append({"event": "train", "round": 2, "phase_label": "dpo:a", "task": "a", "party": "all", "contributors": 3,
                "parties": 3, "task_loss": 0.3, "dpo_margin": 1.25, "dpo_acc": 0.75,
                **sd(task_loss_sd=0.41, dpo_margin_sd=0.82, dpo_acc_sd=0.05)})
    log.append({"event": "rl", "round": 3, "phase_label": "rl:a", "task": "a", "party": "all", "contributors": 3,
                "parties": 3, "engine": "prune-2", "correction": "icepop", "reward": 0.62, "masked_frac_low": 0.013,
                "masked_frac_high": 0.0, "k3": 0.021, "logp_diff_mean": 0.108,
                **sd(reward_sd=0.05, masked_frac_low_sd=0.05, masked_frac_high_sd=0.05, k3_sd=0.05,
                     logp_diff_mean_sd=0.05)})
    log.append({"event": "run_end", "status": "completed", "rounds": 3})
    return run_dir


def test_secure_rl_and_dpo_figures_are_in_the_report_tables(tmp_path: Path) -> None:
    """Under secure aggregation the RL table shows the released mean reward, |Δlogp|, K3 and masked shares (not a
    'reward first → last' of dashes), and dpo rounds their released margin and preference accuracy."""
    md = write_report(_secure_update_run(tmp_path, noised=False)).read_text(encoding="utf-8")
    rl = md.split("## RL rounds (aggregate)")[1]
    assert "| 3 | a | 3 | 0.62 | 0.108 | 0.021 | 0.013 | 0 |" in rl and "first → last" not in rl
    assert "mean DPO margin†" in md and "| 2 | dpo:a | a | 3 | applied | 0.3 | 1.25 | 0.75 |" in md


def test_noised_training_figures_carry_their_noise_scale(tmp_path: Path) -> None:
    """With update noise each released figure shows its std, and a mean within one std of 0 reads '≈ 0 (within
    noise)'; loss.png draws the std as error bars."""
    run_dir = _secure_update_run(tmp_path, noised=True)
    md = write_report(run_dir).read_text(encoding="utf-8")
    assert "| 1 | sft:a | a | 3 | applied | 2.500 ± 0.410 |" in md
    assert "| 2 | dpo:a | a | 3 | applied | ≈ 0 (within noise) | 1.250 ± 0.820 | 0.750 ± 0.050 |" in md
    rl = md.split("## RL rounds (aggregate)")[1]
    assert "| 3 | a | 3 | 0.620 ± 0.050 | 0.108 ± 0.050 | ≈ 0 (within noise) | ≈ 0 (within noise) |" in rl
    assert "carry the update noise" in md


def test_loss_plot_draws_the_update_noise_as_error_bars(tmp_path: Path, monkeypatch) -> None:
    """loss.png and rl.png draw a released figure's update-noise std as error bars, and only where it is noised."""
    import matplotlib.axes

    drawn: list[tuple] = []
    real = matplotlib.axes.Axes.errorbar

    def spy(self, x, y, *a, **kw):
        drawn.append((list(x), list(y), list(kw.get("yerr", []))))
        return real(self, x, y, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
    write_report(_secure_update_run(tmp_path, noised=True))
    assert ([1, 2], [2.5, 0.3], [0.41, 0.41]) in drawn  # loss.png: the task loss with one std each
    assert ([3], [0.62], [0.05]) in drawn  # rl.png: the mean reward
    assert ([3], [0.021], [0.05]) in drawn  # rl.png: the mismatch panel's K3
    drawn.clear()
    write_report(_secure_update_run(tmp_path / "plain", noised=False))
    assert drawn == []  # no noise, no error bars
