"""Fingerprints hold what defines a phase's result, not where its inputs or outputs live (eagle3.identity)."""

from __future__ import annotations

import json
import os
import shutil

from eagle3.identity import model_identity, tokenizer_identity
from tests.merge_helpers import random_datasets
from tests.support.configs import phase


def fake_model(folder, layers=4):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(1 << 20)
    return folder


def test_a_model_folder_copied_elsewhere_is_the_same_model_and_another_config_is_not(tmp_path):
    from eagle3.extract.config import ExtractConfig

    a = fake_model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert model_identity(a) == model_identity(b) == json.loads(json.dumps(model_identity(a)))  # as manifests hold it
    assert model_identity(fake_model(tmp_path / "c", layers=5)) != model_identity(a)

    def states(path):
        return phase(ExtractConfig, model_path=str(path), extract_dir=str(tmp_path / "x"), capture_layers=[1, 2, 3],
                     dtype="float32").state_params()

    assert states(a) == states(b) != states(tmp_path / "c")


def test_datagen_run_fingerprint_holds_the_tokenizer_not_its_path(tmp_path, smollm2_path):
    from eagle3.datagen.run import run_fingerprint
    from eagle3.datagen.config import ClientConfig, DatasetSpec

    copy = tmp_path / "tok"
    copy.mkdir()
    for name in os.listdir(smollm2_path):
        if not name.endswith(".safetensors"):
            shutil.copy(smollm2_path / name, copy / name)
    assert tokenizer_identity(copy) == tokenizer_identity(smollm2_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    spec, client = DatasetSpec(name="A", prompt_file=str(prompts)), ClientConfig(model="m")
    assert run_fingerprint(spec, client, copy) == run_fingerprint(spec, client, smollm2_path)


def test_merge_inputs_moved_elsewhere_are_not_merged_again(tmp_path):
    from eagle3.merge import MergeConfig, run_merge

    random_datasets(tmp_path / "in", n=10)
    cfg = dict(output_dir=str(tmp_path / "out"), vocab_size=49152)
    assert not run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], **cfg))["skipped"]
    os.rename(tmp_path / "in", tmp_path / "moved")
    assert run_merge(phase(MergeConfig, inputs=[str(tmp_path / "moved")], **cfg))["skipped"]
