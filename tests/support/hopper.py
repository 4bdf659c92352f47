"""A Triton kernel as Hopper compiles it, with no GPU: Triton's compiler for sm_90, then its bundled ptxas."""

from __future__ import annotations

import subprocess
from pathlib import Path


def spill_report(fn, constants: dict, pointer_types: dict, work: Path) -> str:
    """ptxas's line for `fn` (a triton.jit function) at `constants`, its pointers typed by `pointer_types` (the
    other arguments i32), 4 warps: "N bytes stack frame, N bytes spill stores, N bytes spill loads"."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, compile

    signature = {a: pointer_types.get(a, "constexpr" if a in constants else "i32") for a in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    ptx = work / f"{fn.fn.__name__}-{'-'.join(map(str, constants.values()))}.ptx"
    ptx.write_text(compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
    out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                         capture_output=True, text=True, check=True)
    return next(line for line in (out.stdout + out.stderr).splitlines() if "spill stores" in line)
