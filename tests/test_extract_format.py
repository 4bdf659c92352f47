import pytest
import torch

from eagle3.extract.format import CorruptChunkError, ShardManifest, write_chunk
from eagle3.extract.reader import HiddenStateReader
from tests.support.reference import reference_states


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


def one_sample_chunk(T: int, H: int, layers: int) -> dict:
    """A chunk's tensors for one sample of T tokens: `layers` capture layers and the final state, bf16, hidden H."""
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
        "aux_hidden": torch.randn(T, layers * H, generator=g).to(torch.bfloat16),
        "final_hidden": torch.randn(T, H, generator=g).to(torch.bfloat16),
        "sample_offsets": torch.tensor([0, T], dtype=torch.int64), "sample_rows": torch.tensor([7], dtype=torch.int64),
    }


def test_durable_chunk_write_queues_each_piece_for_the_disk_as_it_goes(tmp_path, monkeypatch):
    """With fsync (every extraction chunk) the writer hands each 16 MB piece to the disk as soon as it is in the
    file, instead of leaving the whole chunk in the page cache until the final fsync; the bytes are the same."""
    import os

    import eagle3.extract.format as fmt

    if fmt._SYNC_FILE_RANGE is None:
        pytest.skip("no sync_file_range(2) here (Linux only)")
    tensors = one_sample_chunk(2048, 2 * 1024, 4)  # aux 2048 x 4 x 2048 x 2 bytes = 32 MiB, final 8 MiB: 3 pieces
    real, queued = fmt._SYNC_FILE_RANGE, []

    def sync_file_range(fd, offset, nbytes, flags):
        queued.append((os.fstat(fd).st_size, flags))  # how much of the file existed when it was queued
        assert real(fd, offset, nbytes, flags) == 0
        return 0

    monkeypatch.setattr(fmt, "_SYNC_FILE_RANGE", sync_file_range)
    rec = fmt.write_chunk(tmp_path / "durable", 0, tensors, fsync=True)
    assert len(queued) >= 3 and all(f == fmt.SYNC_FILE_RANGE_WRITE for _, f in queued)
    sizes = [s for s, _ in queued]
    assert sizes == sorted(sizes) and sizes[0] < rec.bytes // 2 and sizes[-1] == rec.bytes  # piece by piece
    n = len(queued)
    plain = fmt.write_chunk(tmp_path / "plain", 0, tensors, fsync=False)
    assert len(queued) == n  # no fsync asked, nothing queued early
    assert plain == rec and (tmp_path / "durable" / rec.file).read_bytes() == (tmp_path / "plain" / rec.file).read_bytes()


def test_chunk_is_hashed_on_a_second_thread_piece_by_piece_in_order(tmp_path, monkeypatch):
    """write_chunk hashes each piece on another thread while it writes the next; the digest is still the file's."""
    import hashlib
    import threading

    from eagle3.extract import format as fmt
    from eagle3.io import sha256_file

    monkeypatch.setattr(fmt, "_WRITE_PIECE", 1 << 10)  # many pieces
    threads, real = set(), hashlib.sha256

    class Sha256:
        def __init__(self, data=b""):
            self.h = real(data)

        def update(self, piece):
            threads.add(threading.get_ident())
            self.h.update(piece)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(fmt.hashlib, "sha256", Sha256)
    rec = fmt.write_chunk(tmp_path, 0, one_sample_chunk(64, 32, 3), fsync=False)
    monkeypatch.undo()
    assert threads and threading.get_ident() not in threads
    assert rec.sha256 == sha256_file(tmp_path / rec.file)
    assert rec.bytes == (tmp_path / rec.file).stat().st_size > 10 * (1 << 10)  # (many pieces)
