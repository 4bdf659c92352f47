"""The quality benchmark's recipe rule (bench/quality_plan.py): per knob, the ablation row with the highest tau when
it beats the base run by more than the margin; ties keep the base value; sampled answers are never adopted."""

from __future__ import annotations

from types import SimpleNamespace

from bench.quality_plan import MARGIN, ORDER, main_variant, plan, recipe


def args(**kw):
    base = dict(epochs=3, ttt_steps=7, draft_vocab=32000, lr=8e-4, batch_size=32, max_seq_len=512, temperature=0.8,
                ks=[5, 7], ablation_eval_new_tokens=256, ablations="all")
    return SimpleNamespace(**{**base, **kw})


def rows_with(taus: dict[str, float]) -> list[dict]:
    return [{"name": n, "status": "done", "tau": {"5": t}} for n, t in taus.items()]


def test_recipe_adopts_a_clear_win_per_knob_and_keeps_base_on_a_tie_or_a_loss():
    variants = plan(args(), ablation_parts=3)
    rows = rows_with({"base": 1.45, "ttt1": 1.40, "ttt3": 1.49, "epochs1": 1.26, "epochs6": 1.58,
                      "vocab8k": 1.45, "lr2e-3": 1.45 + MARGIN / 2, "seq2048": 1.46, "fp8": 1.50, "sampled": 1.9})
    train, data, why = recipe(rows, variants)
    assert train == {"ttt_steps": 3, "epochs": 6}
    assert data == {"storage": "float8_e4m3fn"}  # a data knob goes to the data variant, not the trainer
    assert any(w.startswith("lr: base kept") for w in why)  # within the margin
    assert not any(w.startswith("answers") for w in why)  # the main run's answers stay greedy


def test_recipe_without_a_finished_base_run_keeps_every_base_value():
    variants = plan(args(), ablation_parts=3)
    rows = rows_with({"epochs6": 2.0}) + [{"name": "base", "status": "failed: out of time"}]
    assert recipe(rows, variants)[:2] == ({}, {})


def test_plan_runs_base_first_then_the_asked_rows_in_order_on_equal_data():
    variants = plan(args(ablations="epochs6,ttt1"), ablation_parts=3)
    assert [v.name for v in variants] == ["base", "epochs6", "ttt1"]
    assert {v.data.parts for v in variants} == {3} and all(v.ks == [5] for v in variants)
    assert [v.name for v in plan(args(), 3)][1:] == ORDER


def test_main_variant_is_the_base_run_on_every_part_with_the_recipe_on_top():
    base = plan(args(), ablation_parts=3)[0]
    main = main_variant(base, 16, {"epochs": 6}, {"storage": "float8_e4m3fn"}, [5, 7], 512)
    assert main.train == {**base.train, "epochs": 6} and main.data.parts == 16
    assert (main.data.storage, main.data.max_seq_len, main.data.answers) == ("float8_e4m3fn", 512, "greedy")
    assert main.ks == [5, 7] and main.eval_new_tokens == 512 and "epochs 6" in main.change
