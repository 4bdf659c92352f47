import pytest
import torch

from eagle3.extract.format import CorruptChunkError, ShardManifest, write_chunk
from eagle3.extract.reader import HiddenStateReader
from eagle3.extract.reference import reference_states


def make_chunk(model, samples, rows, layers):
    auxs, finals = zip(*(reference_states(model, s, layers) for s in samples))
    lens = [len(s) for s in samples]
    return {
        "input_ids": torch.tensor([t for s in samples for t in s], dtype=torch.int32),
        "loss_mask": torch.ones(sum(lens), dtype=torch.uint8),
        "aux_hidden": torch.cat(auxs).to(torch.bfloat16),
        "final_hidden": torch.cat(finals).to(torch.bfloat16),
        "sample_offsets": torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64),
        "sample_rows": torch.tensor(rows, dtype=torch.int64),
    }


def test_chunks_round_trip_through_reader_and_detect_corruption(tmp_path, smollm2_model):
    layers = [2, 15, 27]
    m = ShardManifest(shard=0, model_path="smollm2", capture_layers=layers, hidden_size=576, dtype="bfloat16")
    samples = [[1, 504, 3458, 2], [1, 9690, 28, 47, 2], [1, 17, 2]]
    m.chunks.append(write_chunk(tmp_path, 0, make_chunk(smollm2_model, samples[:2], [0, 1], layers)))
    m.chunks.append(write_chunk(tmp_path, 1, make_chunk(smollm2_model, samples[2:], [2], layers)))
    m.complete = True
    m.save(tmp_path)

    reader = HiddenStateReader([tmp_path], verify=True)
    got = list(reader)
    assert [s.row for s in got] == [0, 1, 2]
    assert reader.num_tokens == 12 and reader.num_samples == 3
    aux, final = reference_states(smollm2_model, samples[1], layers)
    assert got[1].input_ids.tolist() == samples[1]
    torch.testing.assert_close(got[1].aux_hidden.float(), aux.to(torch.bfloat16).float())
    assert got[1].aux_hidden.shape == (5, 3 * 576)
    assert got[1].final_hidden.shape == (5, 576)

    # flip one byte in the second chunk: verify names the file
    p = tmp_path / "chunk-000001.safetensors"
    data = bytearray(p.read_bytes())
    data[-10] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match="chunk-000001.safetensors: checksum mismatch"):
        list(HiddenStateReader([tmp_path], verify=True))
    p.unlink()
    with pytest.raises(CorruptChunkError, match="chunk-000001.safetensors: chunk listed in the manifest is missing"):
        list(HiddenStateReader([tmp_path]))


def test_incomplete_shard_is_refused(tmp_path):
    ShardManifest(shard=3, model_path="m", capture_layers=[1], hidden_size=8, dtype="bfloat16").save(tmp_path)
    with pytest.raises(CorruptChunkError, match="shard 3 is not complete"):
        HiddenStateReader([tmp_path])
    with pytest.raises(CorruptChunkError, match="manifest is missing"):
        HiddenStateReader([tmp_path / "nope"])
