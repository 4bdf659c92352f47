"""The extraction params that need no model: resolved per device (compile, pad_multiple, token_budget, chunk_mb,
attention), junk refused naming the param, and the trigger form's choices equal what the torch side runs."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.extract.batches import AUTO_PAD_MULTIPLE, PlanSegment, host_buffer_rows, padded_length, plan_batches
from eagle3.extract.config import ExtractConfig
from eagle3.extract.extractor import resolve_for_device
from tests.support.configs import phase

ROOT = Path(__file__).resolve().parents[1]


def test_auto_padding_bounds_batch_lengths_and_their_padding(tmp_path):
    """pad_multiple="auto" (the GPU default): lengths 256..8192 meet 145 padded lengths instead of 7,937, each
    within 1/16 of the longest sample, multiples of 64 from 1,024 tokens on; the CPU resolves auto to 1 (its
    kernels build nothing per shape); a rendered template ("16") parses to an int; anything else names the param."""
    padded = {n: padded_length(n, "auto") for n in range(1, 8193)}
    assert all(n <= L and (L - n) * 16 < n for n, L in padded.items() if L != n)
    assert all(L == n for n, L in padded.items() if n < 32)  # too short to pad by under 1/16
    assert all(L % AUTO_PAD_MULTIPLE == 0 for n, L in padded.items() if n >= 16 * AUTO_PAD_MULTIPLE)
    assert len({padded[n] for n in range(256, 8193)}) == 145
    assert [padded_length(n, 64) for n in (1, 64, 65, 300)] == [64, 64, 128, 320]  # an int is an exact multiple
    rng = np.random.default_rng(0)
    lengths = rng.integers(256, 8193, 2000)
    batches = [b for c in plan_batches(lengths, np.arange(2000), 32768, 1 << 40, "auto") for b in c]
    assert sorted(int(i) for b in batches for i in b) == list(range(2000))
    assert all(len(b) * padded_length(int(lengths[b].max()), "auto") <= 32768 for b in batches)
    assert len({(len(b), padded_length(int(lengths[b].max()), "auto")) for b in batches}) <= 2 * 145

    base = dict(model_path="m", extract_dir=str(tmp_path))
    assert resolve_for_device(phase(ExtractConfig, **base, device="cpu")).pad_multiple == 1
    assert resolve_for_device(phase(ExtractConfig, **base, device="cuda")).pad_multiple == "auto"
    assert phase(ExtractConfig, **base, device="cpu", pad_multiple=16).pad_multiple == 16
    # the form's text "16" is read as 16 where the form is read (eagle3.config), not by the config
    from eagle3.config import RunConfig

    assert RunConfig.from_params({"extract_pad_multiple": "16"}, "r").extract.pad_multiple == 16
    for bad in ("sixty", "-4", "16", 0, True):
        with pytest.raises(ConfigError, match=rf"extract param pad_multiple \(trigger-form param "
                                              rf"extract_pad_multiple\) must .*got {bad!r}"):
            phase(ExtractConfig, **base, device="cpu", pad_multiple=bad)
    # token_budget and chunk_mb: auto = big batches and chunk files on a GPU, small ones on the CPU (AUTO_PLAN)
    cpu, gpu = (resolve_for_device(phase(ExtractConfig, **base, device=d)) for d in ("cpu", "cuda"))
    assert (cpu.token_budget, cpu.chunk_mb, gpu.token_budget, gpu.chunk_mb) == (256, 1, 16384, 1024)
    # storage_dtype: auto = fp8 where the target computes in 16 bits (a GPU's bf16: half the disk, the same tau,
    # docs/benchmarks.md), the compute dtype else (the CPU's float32); a named dtype is kept
    assert (cpu.storage_dtype, gpu.storage_dtype) == ("float32", "float8_e4m3fn")
    fp16, named = (resolve_for_device(phase(ExtractConfig, **base, device="cuda", **kw))
                   for kw in ({"dtype": "float16"}, {"storage_dtype": "bfloat16"}))
    assert (fp16.storage_dtype, named.storage_dtype) == ("float8_e4m3fn", "bfloat16")
    given = resolve_for_device(phase(ExtractConfig, **base, device="cpu", token_budget=4096, chunk_mb=0.5))
    assert (given.token_budget, given.chunk_mb) == (4096, 0.5)
    form = RunConfig.from_params({"token_budget": "512", "chunk_mb": "0.5"}, "r").extract  # the form's text
    assert (form.token_budget, form.chunk_mb) == (512, 0.5)
    for name, bad, why in (("token_budget", "big", "must match"), ("chunk_mb", "2", "must be a number or 'auto'"),
                           ("chunk_mb", 0, "must be > 0")):
        with pytest.raises(ConfigError, match=rf"extract param {name} .*{why}"):
            phase(ExtractConfig, **base, **{name: bad})


def test_host_buffers_of_every_shard_that_fills_them_are_one_size():
    """Two shards of other lengths planned alike ask for host buffers of the plan's bound (so a process running
    both reuses the first one's pinned blocks); a shard under the bound asks for its largest chunk; a sample over
    the token budget, a chunk alone, for its length."""
    rng = np.random.default_rng(1)
    plan = PlanSegment(0, 32768, 65516, "auto")

    def rows(lengths):
        lengths = np.asarray(lengths)
        chunks = plan_batches(lengths, np.arange(len(lengths)), plan.token_budget, plan.chunk_tokens, "auto")
        return host_buffer_rows(lengths, chunks, plan), max(int(lengths[np.concatenate(c)].sum()) for c in chunks)

    (a, a_largest), (b, b_largest) = rows(rng.integers(256, 8193, 400)), rows(rng.integers(256, 8193, 30))
    assert a == b == 65516 and a_largest != b_largest and max(a_largest, b_largest) <= 65516
    assert rows([300, 200, 100]) == (600, 600)
    assert rows([70000] + [5000] * 20)[0] == 70000


def test_compile_param_resolves_per_device_and_rejects_junk(tmp_path):
    base = dict(model_path="m", extract_dir=str(tmp_path))
    assert resolve_for_device(phase(ExtractConfig, **base, device="cpu")).compile is False
    assert resolve_for_device(phase(ExtractConfig, **base, device="cuda")).compile is True
    assert resolve_for_device(phase(ExtractConfig, **base, device="cuda", compile=False)).compile is False
    for junk in ("maybe", "False"):  # a native config has no text booleans
        with pytest.raises(ConfigError, match=f"extract param compile must be true, false or 'auto', got '{junk}'"):
            phase(ExtractConfig, **base, device="cpu", compile=junk)


def test_attention_param_rejects_unknown_and_cuda_only_kernels_on_cpu(tmp_path):
    base = dict(model_path="m", extract_dir=str(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match=r"attention \(trigger-form param extract_attention\)='flash3': use one of "
                                          r"\['auto', 'flash', 'cudnn'"):
        phase(ExtractConfig, **base, attention="flash3")
    with pytest.raises(ConfigError, match="attention='cudnn' needs a CUDA device, the run is on cpu"):
        resolve_for_device(phase(ExtractConfig, **base, attention="cudnn"))
    assert resolve_for_device(phase(ExtractConfig, **{**base, "device": "cuda"}, attention="cudnn")).attention == "cudnn"
    # a pinned kernel that cannot run the call (flash on the CPU, 4 query heads over 2 KV heads without
    # enable_gqa) names the param instead of torch's bare "No available kernel"
    from eagle3.extract.backend import pinned_attention

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ConfigError, match=r"attention='flash': torch has no flash SDPA kernel .* on cpu .*"
                                          r"use attention='auto'"):
        with pinned_attention("flash", "cpu"):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)


def test_fused_llama_backend_refuses_other_architectures_by_name(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eagle3.extract.fused_llama import FusedLlamaBackend

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, attention_bias=True, hidden_act="gelu")
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match="backend 'fused-llama' cannot run model_type 'llama': attention "
                                          "projections have biases; hidden_act is 'gelu', not 'silu'"):
        FusedLlamaBackend(model=model).load("", "float32", "cpu", [1])
    with pytest.raises(ConfigError, match=r"backend \(trigger-form param extract_backend\)='tensorrt': use one of "
                                          r"\['hf', 'fused-llama'\]"):
        phase(ExtractConfig, model_path="m", extract_dir=str(tmp_path), backend="tensorrt")


def test_torch_free_choices_equal_what_the_torch_side_accepts():
    """The trigger form offers the config's choices; each must be one the torch side runs, and none missing. The
    config, the batch plan and the shard plan import no torch (the DAG and the run config import them)."""
    from eagle3.extract import config as c
    from eagle3.extract.backend import DTYPES, SDPA_KERNELS
    from eagle3.extract.extractor import BACKENDS, STORAGE_DTYPES

    assert c.ATTENTION_CHOICES == tuple(SDPA_KERNELS)
    assert c.BACKEND_CHOICES == tuple(BACKENDS)
    assert c.DTYPE_CHOICES == ("auto", *DTYPES)
    assert c.STORAGE_DTYPE_CHOICES == ("auto", *STORAGE_DTYPES)
    code = ("import sys; import eagle3.extract.config, eagle3.extract.batches, eagle3.extract.plan, "
            "eagle3.merge.dataset; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
