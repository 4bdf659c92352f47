"""The plain reference extraction: one sample at a time through `output_hidden_states=True`.

It is the correctness oracle for the fast extractor and the naive baseline of its benchmark.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_states(model, input_ids: list[int], capture_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (aux [T, n*H], final [T, H]) for one sample; final is hidden_states[-1] (after the final norm)."""
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    aux = torch.cat([hs[i][0] for i in capture_layers], dim=-1)
    return aux, hs[-1][0]
