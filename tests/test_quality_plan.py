"""The quality benchmark's recipe rule (bench/quality_plan.py): per knob, the ablation row with the highest tau when
it beats the base run by more than the margin; ties keep the base value; sampled answers are never adopted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.quality_plan import MARGIN, ORDER, main_variant, plan, recipe
from eagle3.sections import TargetConfig
from eagle3.train.config import TrainConfig


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


def test_round2_studies_run_the_default_recipe_on_growing_data_and_name_their_comparisons():
    from bench.quality_plan import ROUND2_RECIPE, studies

    a = args(studies="data,epochs,fp8,selection,goal", all_turns_seq_len=2048, study_data="first", eval_new_tokens=512)
    rows = {v.name: v for v in studies(a, total_parts=16)}
    assert list(rows) == ["data3k", "data7k", "data_first", "data_all", "data_x2", "epochs4", "epochs8", "epochs12",
                          "epochs16", "fp8_first", "fp8w_first", "best_ckpt_first", "goal"]
    assert [rows[n].data.parts for n in ("data3k", "data7k", "data_first")] == [3, 7, 16]
    assert rows["data_all"].data.turns == "all" and rows["data_all"].data.storage == "float8_e4m3fn"
    assert rows["data_all"].data.max_seq_len == 2048 and rows["data_first"].data.max_seq_len == 512
    # every turn at 2,048 tokens: the 32 samples of a step as 2 micro-batches (batch 32 outgrew an 80 GB card)
    assert rows["data_all"].train == {**ROUND2_RECIPE, "batch_size": 16, "grad_accum": 2}
    # data_x2: every turn's data with a second, sampled answer set beside the greedy one
    assert rows["data_x2"].data == replace(rows["data_all"].data, answers="greedy+sampled")
    assert rows["data_x2"].data.answer_sets == ["greedy", "sampled"] and rows["data_x2"].train == rows["data_all"].train
    # the goal row: data_x2's data at the trainer's default epochs (the sweep's choice), as a trainer built with no
    # epochs runs them
    shipped = TrainConfig(output_dir="o", target=TargetConfig(model_path="m")).epochs
    assert rows["goal"].data == rows["data_x2"].data and rows["goal"].train == {**rows["data_x2"].train,
                                                                                "epochs": shipped}
    # fp8 and the chosen checkpoint differ from data_first in their one knob; the epochs rows in epochs alone
    assert rows["fp8_first"].data == replace(rows["data_first"].data, storage="float8_e4m3fn")
    assert rows["fp8w_first"].data == replace(rows["data_first"].data, weights="fp8")
    assert rows["fp8w_first"].train == rows["data_first"].train
    assert rows["best_ckpt_first"].train == {**ROUND2_RECIPE, "holdout_fraction": 0.02, "validate_every": 200}
    assert rows["epochs12"].train == {**ROUND2_RECIPE, "epochs": 12}
    assert rows["epochs12"].data == rows["data_first"].data
    assert all(v.ks == [5, 7] and v.eval_new_tokens == 512 for v in rows.values())
    assert [v.name for v in studies(replace_ns(a, studies="fp8_first,data3k"), 16)] == ["fp8_first", "data3k"]
    with pytest.raises(SystemExit, match="unknown"):
        studies(replace_ns(a, studies="data99k"), 16)


def replace_ns(ns, **kw):
    return SimpleNamespace(**{**vars(ns), **kw})


def test_first_turns_cut_an_all_turn_sample_after_its_first_answer(tmp_path):
    import json

    from bench.quality_prompts import first_turns

    src = tmp_path / "all"
    src.mkdir()
    sample = {"sample_id": "s", "dataset": "P000", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9],
              "loss_mask": [0, 0, 1, 1, 0, 0, 1, 1, 1], "turns": 2}
    one = {"sample_id": "t", "dataset": "P000", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "turns": 1}
    (src / "tokenized.jsonl").write_text(json.dumps(sample) + "\n" + json.dumps(one) + "\n")
    first_turns(src, tmp_path / "first")
    got = [json.loads(ln) for ln in (tmp_path / "first" / "tokenized.jsonl").read_text().splitlines()]
    assert got == [{**sample, "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "turns": 1}, one]


def test_two_answer_sets_merge_under_distinct_dataset_names(tmp_path):
    """greedy+sampled merges both sets' parts: P000... and S000..., since a merge refuses a dataset name twice."""
    from bench.quality_plan import DataVariant
    from bench.quality_prompts import answered_parts, part_name, write_part
    from bench.train_quality_gpu import merge_inputs

    a = SimpleNamespace(gen_turns="all")
    d = DataVariant(answers="greedy+sampled", parts=2, turns="all")
    got = merge_inputs(a, tmp_path, d)
    assert [Path(p).relative_to(tmp_path).as_posix() for p in got] == [
        "datagen/greedy/P000", "datagen/greedy/P001", "datagen/sampled/S000", "datagen/sampled/S001"]
    sample = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "turns": 1}
    for p in range(2):  # as generate() writes them: the part's folder is its dataset name
        write_part(tmp_path / "datagen" / "sampled" / part_name("sampled", p), [sample], "sampled", p)
    assert answered_parts(tmp_path / "datagen" / "sampled", 1, 3) == (2, 2)
    line = (tmp_path / "datagen" / "sampled" / "S001" / "tokenized.jsonl").read_text()
    assert '"dataset": "S001"' in line and '"sample_id": "sampled-1"' in line
