import pytest

from eagle3.errors import ConfigError
from eagle3.faults import InjectedFault, maybe_inject_fault, parse_fault


def test_fault_fires_once_for_its_shard_after_k_chunks(tmp_path):
    once = tmp_path / "sub" / "fired"
    env = {"EAGLE3_INJECT_FAULT": f"shard=2,after_chunks=3,once_file={once}"}
    for chunks in range(3):
        maybe_inject_fault(2, chunks, env)  # not yet
    maybe_inject_fault(1, 5, env)  # another shard
    with pytest.raises(InjectedFault, match="shard 2 after 3 committed chunks"):
        maybe_inject_fault(2, 3, env)
    assert once.exists()
    maybe_inject_fault(2, 3, env)  # the re-run passes
    maybe_inject_fault(2, 3, {})


def test_bad_spec_names_the_variable():
    with pytest.raises(ConfigError, match="EAGLE3_INJECT_FAULT='shard=x'"):
        parse_fault("shard=x")
