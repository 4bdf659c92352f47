"""`fused_moe.align_pairs` on a GPU: the (token, expert) pairs in expert order, as a stable counting sort in two
Triton kernels, where the torch ops sort the pairs' 64-bit expert ids by radix (several passes over them) and then
scatter, gather and search with a dozen more small kernels: about 2% of the Qwen3-30B-A3B forward's kernel time on
the H200 (docs/benchmarks.md), for a sort whose keys take 7 or 8 bits.

The S pairs are cut into chunks of CHUNK; `count_kernel` counts each chunk's pairs per expert group; torch's ops on
that small [chunks, groups] table give each (chunk, group) its first slot (the groups' starts padded to whole
blocks, plus the pairs of the same group in the chunks before); `place_kernel` writes each pair's index to its
slot, in order within its chunk (a running count per group, and a prefix sum over one-hot rows within each step).
The result is the torch ops' to the byte (a stable sort keeps the pairs' order within an expert): the kernels that
read it compute the same rows. Both kernels run in Triton's interpreter on the CPU (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from eagle3.extract.fused_moe import padded_groups, pair_capacity


def count_kernel(ids_ptr, counts_ptr, S, last_group, CHUNK: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):
    """counts[c, g] = pairs of chunk c routed to group g (ids past last_group count as last_group)."""
    c = tl.program_id(0)
    groups = tl.arange(0, G)
    total = tl.full((G,), 0, tl.int32)
    for step in tl.range(0, CHUNK, BLOCK):
        offs = c * CHUNK + step + tl.arange(0, BLOCK)
        ok = offs < S
        e = tl.minimum(tl.load(ids_ptr + offs, mask=ok, other=0), last_group)
        onehot = ((e[:, None] == groups[None, :]) & ok[:, None]).to(tl.int32)
        total += tl.reduce(onehot, 0, tl.standard._sum_combine)  # (the interpreter maps this to numpy's sum)
    tl.store(counts_ptr + c * G + groups, total)


def place_kernel(ids_ptr, first_ptr, pairs_ptr, S, last_group, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 G: tl.constexpr):
    """pairs[slot] = i for each pair i of chunk c: its group's first slot for the chunk, plus the pairs of its
    group before it in the chunk."""
    c = tl.program_id(0)
    groups = tl.arange(0, G)
    run = tl.load(first_ptr + c * G + groups)  # the next slot of each group
    for step in tl.range(0, CHUNK, BLOCK):
        offs = c * CHUNK + step + tl.arange(0, BLOCK)
        ok = offs < S
        e = tl.minimum(tl.load(ids_ptr + offs, mask=ok, other=0), last_group)
        onehot = ((e[:, None] == groups[None, :]) & ok[:, None]).to(tl.int32)
        upto = tl.associative_scan(onehot, 0, tl.standard._sum_combine)  # same-group pairs up to each, inclusive
        slot = tl.reduce(tl.where(onehot > 0, run[None, :] + upto - 1, 0), 1, tl.standard._sum_combine)
        tl.store(pairs_ptr + slot, offs.to(tl.int32), mask=ok)
        run += tl.reduce(onehot, 0, tl.standard._sum_combine)


KERNELS = {"cuda": (triton.jit(count_kernel), triton.jit(place_kernel)),
           "cpu": (InterpretedFunction(count_kernel), InterpretedFunction(place_kernel))}


def steps(groups: int, device_type: str) -> tuple[int, int, int]:
    """(G, CHUNK, BLOCK): the groups padded to a power of two; pairs a program; pairs a step, so that a step's
    one-hot [BLOCK, G] tile holds 8K values. On the CPU few programs (the interpreter's time goes by programs)."""
    g = triton.next_power_of_2(groups)
    block = max(16, 8192 // g)
    return g, (1024 if device_type == "cuda" else 8 * block), block


def align_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                elsewhere: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_moe.align_pairs (its docstring), the same bytes, by the two kernels."""
    groups = num_experts + elsewhere
    ids = top_k_index.reshape(-1)
    s, device = ids.numel(), ids.device
    capacity = pair_capacity(s, groups, block_m)
    g, chunk, block = steps(groups, device.type)
    count, place = KERNELS["cuda" if device.type == "cuda" else "cpu"]
    chunks = triton.cdiv(s, chunk)
    counts = torch.empty(chunks, g, dtype=torch.int32, device=device)
    if s:
        count[(chunks,)](ids, counts, s, groups - 1, CHUNK=chunk, BLOCK=block, G=g)
    padded_start, block_expert = padded_groups(counts.sum(0, dtype=torch.int64)[:groups], block_m, capacity)
    # each (chunk, group)'s first slot: the group's padded start, plus its pairs in the chunks before
    first = padded_start[None, :] + torch.cumsum(counts[:, :groups], 0, dtype=torch.int64) - counts[:, :groups]
    first = torch.nn.functional.pad(first, (0, g - groups)).to(torch.int32).contiguous()
    pairs = torch.full((capacity,), s, dtype=torch.int32, device=device)
    if s:
        place[(chunks,)](ids, first, pairs, s, groups - 1, CHUNK=chunk, BLOCK=block, G=g)
    return pairs, block_expert
