"""The extractor's memory guard: the largest planned batch checked against the free memory before any work, an
OOM in the forward recognized, and for both what to change (a token_budget that passes the same check, or at the
floor what else helps).

    check_batch_fits(cfg, hidden, intermediate, storage_bytes, device, batch_tokens, longest)  # ExtractOOMError
"""

from __future__ import annotations

import torch

from eagle3.errors import DeviceOOMError
from eagle3.extract.backend import DTYPES
from eagle3.extract.config import ExtractConfig
from eagle3.knobs import knob_meta


class ExtractOOMError(DeviceOOMError):
    """The token budget does not fit the device; the message names the param and a smaller value. The memory
    pre-check's refusal is not retried (the same plan meets the same memory); an OOM in the forward is
    (another process may have held the memory)."""


def estimate_batch_bytes(token_budget: int, hidden: int, intermediate: int, n_capture: int,
                         compute_bytes: int, storage_bytes: int) -> int:
    """Peak extra memory of one forward of `token_budget` tokens, plus the two staging buffers.

    Activations: the residual stream, a norm output, q/k/v/attention output (~6 x hidden), the
    MLP's gate/up/act (3 x intermediate), the captured layers kept alive until gathered, and
    fp32 temporaries of norms/rope (~2 x hidden x 4 bytes). Deliberately generous.
    """
    act = token_budget * ((8 + n_capture) * hidden + 3 * intermediate) * compute_bytes
    act += token_budget * 2 * hidden * 4
    staging = 2 * token_budget * (n_capture + 1) * hidden * storage_bytes
    return int(act + staging)


def free_device_memory(device: torch.device) -> int:
    """Bytes a batch may take: on a GPU the driver's free memory plus what torch's caching allocator holds
    unused (an earlier shard's batches in the same process: the driver counts them as taken)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + max(0, int(cached))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def check_batch_fits(cfg: ExtractConfig, hidden: int, intermediate: int, storage_bytes: int, device: torch.device,
                     batch_tokens: int, longest: int) -> None:
    """The largest batch the plan forms (`batch_tokens` padded tokens: a sample longer than the budget runs
    alone in a batch larger than the budget) against the free memory, before any work."""
    per_token = estimate_batch_bytes(1, hidden, intermediate, len(cfg.target.capture_layers),
                                     DTYPES[cfg.target.dtype].itemsize, storage_bytes)
    free = free_device_memory(device)
    allowed = free * cfg.memory_headroom
    if per_token * batch_tokens > allowed:
        raise ExtractOOMError(oom_message(cfg.token_budget, device, per_token, allowed, free, batch_tokens, longest),
                              retried=False)


MIN_TOKEN_BUDGET = int(knob_meta(ExtractConfig.__dataclass_fields__["token_budget"])["min"])  # the knob's
AT_THE_FLOOR = ("capture fewer layers (target param capture_layers), split the target over more GPUs (param "
                "extract_tp_size), store fp8 states (param storage_dtype=float8_e4m3fn), shorten the samples (param "
                "max_seq_len), or run on a GPU with more memory")


def _smaller_budget(token_budget: int, what: str, suggest: int) -> str:
    return (f"token_budget={token_budget} {what}: set a smaller token_budget (the extraction param 'token_budget', "
            f"padded tokens per forward pass), e.g. token_budget={suggest}; the committed chunks are kept and the "
            f"rest is planned with the new value")


def oom_message(token_budget: int, device, per_token: int | None = None, allowed: float | None = None,
                free: int | None = None, batch_tokens: int | None = None, longest: int | None = None) -> str:
    """What to change after the memory check (per_token bytes, allowed = headroom x free bytes) or a real OOM
    refused `token_budget`: a budget that passes the same check, or at the floor what else helps.

    A batch holds at most max(token_budget, its longest sample) padded tokens (a longer sample runs alone), so
    a budget helps only while the longest sample fits; below that, and below the knob's minimum, it does not.
    """
    if per_token and allowed and free:
        need = per_token * batch_tokens
        what = (f"needs about {need / 1e9:.2f} GB for its largest batch ({batch_tokens} padded tokens) but only "
                f"{free / 1e9:.2f} GB is free on {device} ({allowed / free:.0%} may be used: param memory_headroom)")
        fits = int(allowed // per_token)
        suggest = max(fits // 64 * 64, min(fits, longest or 0))  # a round value, not below the longest sample
        if suggest >= max(MIN_TOKEN_BUDGET, longest or 0):
            return _smaller_budget(token_budget, what, suggest)
        floor = (f"the longest sample alone ({longest} tokens) does not fit" if longest and longest > fits
                 else f"token_budget cannot go below {MIN_TOKEN_BUDGET}")
        return f"token_budget={token_budget} {what}; {floor}, so a smaller token_budget does not help: {AT_THE_FLOOR}"
    suggest = max(token_budget // 2, MIN_TOKEN_BUDGET, longest or 0)
    if suggest < max(token_budget, longest or 0):  # a smaller largest batch
        return _smaller_budget(token_budget, f"ran out of memory on {device}", suggest)
    return (f"token_budget={token_budget} ran out of memory on {device} with batches of at most "
            f"{max(token_budget, longest or 0)} padded tokens, at the floor of what token_budget can do: {AT_THE_FLOOR}")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e).lower()))
