import json
import os
import shutil
import time

import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.models import (
    COMPLETE_MARKER, SANITY_PROMPT, align_special_tokens, converted, default_capture_layers, ensure_smollm2,
    find_smollm2_gguf, gguf_special_token_ids, greedy_reply, load_model, load_tokenizer, model_info,
    resolve_capture_layers,
)


def test_cached_model_is_reused_not_reconverted(smollm2_path):
    marker = smollm2_path / COMPLETE_MARKER
    before = marker.stat().st_mtime_ns
    t0 = time.time()
    assert ensure_smollm2(smollm2_path.parent) == smollm2_path
    assert time.time() - t0 < 1.0
    assert marker.stat().st_mtime_ns == before
    meta = json.loads(marker.read_text())
    assert meta["sanity_reply"]  # the conversion verified a non-empty greedy reply


def test_special_tokens_are_the_ggufs_own(smollm2_path, tmp_path):
    """The converted tokenizer's special tokens are the ones the GGUF's metadata names, whatever the tokenizer
    transformers built said (5.17 built this GGUF's with eos = <|im_start|>: answers ran past <|im_end|>); a folder
    converted before that check is converted again."""
    ids = gguf_special_token_ids(find_smollm2_gguf())
    assert (ids["bos_token"], ids["eos_token"], ids["pad_token"]) == (1, 2, 2)
    tok = load_tokenizer(smollm2_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert json.loads((smollm2_path / COMPLETE_MARKER).read_text())["special_tokens"]["eos_token"] == "<|im_end|>"
    tok.eos_token = tok.bos_token  # as transformers 5.17 built it
    assert align_special_tokens(tok, ids, "test")["eos_token"] == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert converted(smollm2_path)
    old = tmp_path / "old"
    old.mkdir()
    meta = json.loads((smollm2_path / COMPLETE_MARKER).read_text())
    del meta["special_tokens"]
    (old / COMPLETE_MARKER).write_text(json.dumps(meta))
    assert not converted(old) and not converted(tmp_path / "missing")


def test_model_info_reads_smollm2_config(smollm2_path):
    info = model_info(smollm2_path)
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert info.model_type == "llama"
    assert default_capture_layers(info.num_layers) == [2, 15, 27]


def test_default_capture_layers_are_distinct_and_ascending_at_every_depth():
    """[2, L//2, L-3] collides below 7 layers ([2, 2, 2] at 5: refused as duplicates by the resolver)."""
    assert default_capture_layers(7) == [2, 3, 4]
    assert [default_capture_layers(n) for n in (3, 4, 5, 6)] == [[1, 2], [1, 2, 3], [1, 2, 4], [1, 3, 5]]
    for n in range(3, 80):
        layers = default_capture_layers(n)
        assert layers == sorted(set(layers)) and 1 <= layers[0] and layers[-1] <= n - 1 and len(layers) >= 2


def test_greedy_reply_from_converted_model(smollm2_model, smollm2_tokenizer):
    reply = greedy_reply(smollm2_model, smollm2_tokenizer, SANITY_PROMPT)
    assert "Paris" in reply


def test_capture_layer_validation_names_layer_and_depth(smollm2_path):
    info = model_info(smollm2_path)
    assert resolve_capture_layers([2, 15, 27], info) == [2, 15, 27]
    assert resolve_capture_layers(None, info) == [2, 15, 27]
    with pytest.raises(ConfigError, match=r"capture layer 58 is out of range.*30 decoder layers.*1\.\.29"):
        resolve_capture_layers([2, 15, 58], info)
    with pytest.raises(ConfigError, match="duplicates"):
        resolve_capture_layers([2, 2, 5], info)
    with pytest.raises(ConfigError, match="not an int"):
        resolve_capture_layers([2, "x", 5], info)


def test_capture_layers_unsorted_empty_or_embeddings_are_refused(smollm2_path):
    """[15, 2, 27] would export ids [14, 1, 26] while engines feed the aux states in layer order (a permuted fc
    input); [] used to become the default silently; 0 (the embeddings) exported layer id -1."""
    info = model_info(smollm2_path)
    with pytest.raises(ConfigError, match=r"ascending, got \[15, 2, 27\] \(use \[2, 15, 27\]\)"):
        resolve_capture_layers([15, 2, 27], info)
    with pytest.raises(ConfigError, match="non-empty list"):
        resolve_capture_layers([], info)
    with pytest.raises(ConfigError, match="embeddings"):
        resolve_capture_layers([0, 15, 27], info)


def test_model_info_errors_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        model_info(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        model_info(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="missing field 'num_hidden_layers'"):
        model_info(tmp_path)


@pytest.mark.slow
def test_conversion_from_gguf_matches_cached_model(tmp_path, smollm2_path, smollm2_model):
    """Convert the shipped GGUF afresh, reload it, and get the same logits as the cached folder."""
    out = ensure_smollm2(tmp_path)
    assert out == tmp_path / "SmolLM2-135M-Instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER):
        assert (out / name).is_file(), name
    assert not list(tmp_path.glob(".*tmp*"))  # the temp folder was renamed, nothing left behind
    fresh = load_model(out)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, smollm2_model(ids).logits)
    assert find_smollm2_gguf().is_file()
