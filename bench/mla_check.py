"""MLA's query/key assembly in three memory layouts, each with the attention that reads it (a lever of issue 28).

Multi-head latent attention (DeepSeek-V3: 128 heads, q/k 192 wide = nope 128 + rope 64, v 128) splits each head's
projected q into a pass-through and a rotary part, ropes the rotary part, and joins them again; each head's k is
its own nope part joined with one shared, roped rotary part. transformers builds q and k heads-major ([B, heads,
L, 192], the view the attention reads) from the projections' token-major rows. Compiled, each join is one of
Inductor's pointwise kernels; on the H100 at DeepSeek-V3's width the two ran at about 1 TB/s, a third of the
memory's rate, and took 8% of the forward's kernel time (2026-12-07, bench/results/moe-dsv3-4layers-extractor-
profile-h100-2026-12-07-J.json). Built token-major ([B, L, heads, 192], the projections' own order) and handed
to the attention as the transposed view, the same values move in the order they are read. In place (mla_joins
"in-place"), nothing is joined: q's rope slice is roped where the projection wrote it, and the shared roped key is
written into a gap that kv_b's re-laid weight rows leave in its output ([k_nope | gap | v] a head); its price is
kv_b's GEMM rope / (nope + v) wider, timed beside it (`kv_b_gemm_ms`, plain and gapped). Here its writes go into
the compiled function's inputs, which Inductor compiles as all of q's and kv's rows written anew and copied back
(read on the CPU): its row overstates its cost; the whole extractor's side-by-side run is its figure.

The layouts run here side by side, compiled as the extractor compiles (torch.compile, default mode), on the same
inputs: the assembly alone (its memory rate against a plain copy of the same bytes) and assembly + causal SDPA
(what the forward pays, the attention kernel's own choice of layout included). Each layout's q, k, v and
attention output are compared with heads-major's (its row's `q_equal`, ...), so a layout that changes a value is
seen. `--smoke`: CPU, eager, a few heads (the code path, not a figure).

  python3 bench/mla_check.py --tokens 8192,32768 --out $OUT/mla.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.extract_moe import median_time  # noqa: E402
from eagle3.extract.mla import gap_rows, join_in_place, join_token_major  # noqa: E402

DSV3 = {"heads": 128, "nope": 128, "rope": 64, "v": 128, "lora": 512}


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary embedding over interleaved pairs (x0, x1), (x2, x3), ... (transformers'
    apply_rotary_pos_emb_interleave); `cos`/`sin` broadcast to x, as cat(freqs, freqs)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_pair(q, k, cos, sin, unsqueeze_dim: int):
    """rope_interleaved on q and k, with transformers' rope signature (what eagle3.extract.mla hands its rope)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)


def mla_inputs(tokens: int, dims: dict, device, dtype, seed: int = 0) -> dict:
    """What the attention's projections hand over for one [1, tokens] batch: q's rows, kv_b's rows (nope | v per
    head), the shared rotary key, and the position's cos/sin; the in-place layout's own copies (in_place_rows)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    H, nope, rope, v = dims["heads"], dims["nope"], dims["rope"], dims["v"]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    pos = torch.arange(tokens, dtype=torch.float32)[:, None]
    freqs = pos / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    ang = torch.cat([freqs, freqs], dim=-1)[None]
    x = {"q": rand(1, tokens, H * (nope + rope)), "kv": rand(1, tokens, H * (nope + v)),
         "k_rot": rand(1, tokens, rope), "cos": ang.cos().to(device, dtype), "sin": ang.sin().to(device, dtype),
         "dims": dims}
    return {**x, **in_place_rows(x)}


def in_place_rows(x: dict) -> dict:
    """The in-place layout's q and kv_b rows, which it writes into: a copy of q's, and kv's with the gap that kv_b's
    weight re-laid by the extractor's own gap_rows leaves (zeros: x @ W.T's gap rows)."""
    H, nope, rope, v = (x["dims"][k] for k in ("heads", "nope", "rope", "v"))
    kv = gap_rows(x["kv"][0].T, H, nope, rope, v).T.contiguous()[None]
    return {"q_in_place": x["q"].clone(), "kv_gapped": kv}


def assemble_heads_major(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' order: transpose to [B, heads, L, d] first, then split, rope and join there."""
    H, nope, rope, v = (x["dims"][k] for k in ("heads", "nope", "rope", "v"))
    B, L, _ = x["q"].shape
    q = x["q"].view(B, L, H, nope + rope).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv = x["kv"].view(B, L, H, nope + v).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, v], dim=-1)
    q_rot, k_rot = rope_pair(q_rot, x["k_rot"].view(B, 1, L, rope), x["cos"], x["sin"], unsqueeze_dim=1)
    return torch.cat((q_pass, q_rot), dim=-1), torch.cat((k_nope, k_rot.expand(B, H, L, rope)), dim=-1), value


def assemble_token_major(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same values joined in [B, L, heads, d], the projections' order, by the extractor's own code
    (eagle3.extract.mla, mla_joins="token-major"); returned as the [B, heads, L, d] views."""
    nope, rope, v = (x["dims"][k] for k in ("nope", "rope", "v"))
    return join_token_major(x["q"], x["kv"], x["k_rot"], x["cos"], x["sin"], nope, rope, v, rope_pair)


def assemble_in_place(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same values with nothing joined (mla_joins="in-place"): q's rope slice roped in place, the shared key
    written into kv_b's gapped rows; q, k and v are [B, heads, L, d] views of them. Writes into x's in-place rows."""
    nope, rope, v = (x["dims"][k] for k in ("nope", "rope", "v"))
    return join_in_place(x["q_in_place"], x["kv_gapped"], x["k_rot"], x["cos"], x["sin"], nope, rope, v, rope_pair)


LAYOUTS = {"heads_major": assemble_heads_major, "token_major": assemble_token_major, "in_place": assemble_in_place}


def attention(assemble):
    def run(x: dict) -> torch.Tensor:
        q, k, v = assemble(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)  # as transformers' sdpa forward hands o_proj
    return run


def assembly_bytes(x: dict, layout: str = "heads_major") -> int:
    """The bytes the two joins must move at least: q read and written, k's nope part read and k written; in place,
    q's rope slice read and written and k's written."""
    H, nope, rope = (x["dims"][k] for k in ("heads", "nope", "rope"))
    T, e = x["q"].shape[1], x["q"].element_size()
    return T * H * e * (3 * rope if layout == "in_place" else 2 * (nope + rope) + nope + (nope + rope))


def kv_b_gemm_ms(x: dict, device, reps: int, wrap) -> dict:
    """kv_b's GEMM over one batch's latent rows, its weight as transformers lays it and with in-place's gap rows."""
    H, nope, rope, v, lora = (x["dims"][k] for k in ("heads", "nope", "rope", "v", "lora"))
    g = torch.Generator(device="cpu").manual_seed(1)
    latent = torch.randn(1, x["q"].shape[1], lora, generator=g).to(x["q"])
    w = torch.randn(H * (nope + v), lora, generator=g).to(x["q"])
    gemm = wrap(F.linear)
    return {name: round(1e3 * median_time(lambda w=w: gemm(latent, w), device, reps), 4)
            for name, w in (("plain", w), ("gapped", gap_rows(w, H, nope, rope, v)))}


def check(tokens: int, dims: dict, device, dtype, reps: int, compiled: bool) -> dict:
    x = mla_inputs(tokens, dims, device, dtype)
    wrap = (lambda f: torch.compile(f, dynamic=False)) if compiled else (lambda f: f)
    row: dict = {"tokens": tokens, "compiled": compiled}
    outs = {}
    for name, assemble in LAYOUTS.items():
        join = wrap(lambda x, a=assemble: a(x))  # q, k (both joins' outputs, as made: no copy after) and v
        full = wrap(attention(assemble))
        ms_join, ms_full = (1e3 * median_time(lambda f=f: f(x), device, reps) for f in (join, full))
        x.update(in_place_rows(x))  # in place, each call ropes its q again: fresh rows for the values compared
        qkv = [t.contiguous() for t in join(x)]  # as compiled: Inductor may round the rope otherwise than eager
        x.update(in_place_rows(x))
        outs[name] = (*qkv, full(x))
        row[name] = {"assembly_ms": round(ms_join, 4), "attention_ms": round(ms_full, 4),
                     "assembly_tb_s": round(assembly_bytes(x, name) / ms_join / 1e9, 3)}
    copy_src = torch.empty(assembly_bytes(x) // 2, dtype=torch.uint8, device=device)
    row["copy_tb_s"] = round(assembly_bytes(x) / (1e3 * median_time(copy_src.clone, device, reps)) / 1e9, 3)
    row["kv_b_gemm_ms"] = kv_b_gemm_ms(x, device, reps, wrap)
    (qa, ka, va, oa), hm = outs["heads_major"], row["heads_major"]
    for name in list(LAYOUTS)[1:]:  # each against transformers' heads-major
        (qb, kb, vb, ob), r = outs[name], row[name]
        r.update(q_equal=bool(torch.equal(qa, qb)), k_equal=bool(torch.equal(ka, kb)),
                 v_equal=bool(torch.equal(va, vb)), out_rel_l2=float((oa.float() - ob.float()).norm() /
                                                                      oa.float().norm()),
                 assembly_speedup=round(hm["assembly_ms"] / r["assembly_ms"], 3),
                 attention_speedup=round(hm["attention_ms"] / r["attention_ms"], 3))
    return row


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,32768", help="tokens of one batch, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, eager, 4 heads, 64 tokens")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    dims = DSV3 if not args.smoke else {"heads": 4, "nope": 16, "rope": 8, "v": 16, "lora": 16}
    tokens = [64] if args.smoke else [int(t) for t in args.tokens.split(",")]
    rows = []
    for t in tokens:
        row = check(t, dims, device, dtype, 3 if args.smoke else args.reps, compiled=cuda)
        rows.append(row)
        print(f"[mla {t} tokens] heads-major assembly {row['heads_major']['assembly_ms']:.3f} ms "
              f"({row['heads_major']['assembly_tb_s']:.2f} TB/s), a copy {row['copy_tb_s']:.2f} TB/s; kv_b's GEMM "
              f"{row['kv_b_gemm_ms']['plain']:.3f} ms, gapped {row['kv_b_gemm_ms']['gapped']:.3f} ms", flush=True)
        for name in list(LAYOUTS)[1:]:
            r = row[name]
            print(f"  {name}: assembly {r['assembly_ms']:.3f} ms ({r['assembly_tb_s']:.2f} TB/s) "
                  f"{r['assembly_speedup']:.3f}x, with the attention {r['attention_speedup']:.3f}x; q/k/v equal "
                  f"{r['q_equal']}/{r['k_equal']}/{r['v_equal']}, out rel L2 {r['out_rel_l2']:.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "dims": dims, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
