"""Reading the model through its named points (qllama.models.points): the logit lens and attention maps.

- `logit_lens`: for the embedding and each block, the tokens the residual stream (`embed`,
  `blk.{i}.resid`) would predict if the model stopped there: the final RMSNorm, the output
  matrix and the family's final softcap, applied with the model's own arithmetic (so the last
  block's row is the model's real prediction).
- `attention_map`: one layer's `attn_probs` over a text, (H, T, T).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import QllamaError


@dataclass
class LensRow:
    """One layer of the lens: `layer` ("embed" or the block index) and its top tokens."""

    layer: str | int
    ids: list[int]
    pieces: list[str]
    probs: list[float]
    logits: list[float]


@dataclass
class LensResult:
    """`tokens`: the input pieces; `position`: the row the lens reads; `rows`: embed, then each block."""

    tokens: list[str]
    position: int
    rows: list[LensRow] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "position": self.position,
                "layers": [{"layer": r.layer, "top": [{"id": i, "piece": p, "prob": pr, "logit": lg}
                                                      for i, p, pr, lg in zip(r.ids, r.pieces, r.probs, r.logits)]}
                           for r in self.rows]}


def _ids(model, prompt: str | Sequence[int]) -> list[int]:
    ids = model.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not ids:
        raise QllamaError("the text has no tokens")
    return ids


def lens_logits(model, resid: np.ndarray) -> np.ndarray:
    """(R, n_embd) residual-stream rows -> (R, n_vocab) logits through the final norm and output."""
    from .models.base import ops
    from .models.step import project
    from .qtensor import quantize_activation

    fm = model.forward_model
    rows = np.ascontiguousarray(resid, dtype=np.float32)
    hn = np.empty_like(rows)
    ops.rmsnorm(rows, fm.weights.output_norm, fm.args.rms_eps, hn)
    return fm.final_logits(project(fm.weights.output, quantize_activation(hn)))


def logit_lens(model, prompt: str | Sequence[int], *, top_k: int = 5, position: int = -1) -> LensResult:
    """The top_k predictions of the residual stream at `position` (default: the last token) after
    the embedding and after each block. `model`: a qllama.Model; prompt: text (BOS added as the
    model asks) or token ids."""
    if top_k < 1:
        raise QllamaError(f"top_k must be >= 1, got {top_k}")
    ids = _ids(model, prompt)
    if not -len(ids) <= position < len(ids):
        raise QllamaError(f"position {position} is outside the {len(ids)} tokens")
    with model.trace(capture=["embed", "blk.*.resid"]) as t:
        model.logits(ids)
    n_layer = model.args.n_layer
    names = ["embed"] + [f"blk.{i}.resid" for i in range(n_layer)]
    resid = np.stack([t[n][position] for n in names])  # (n_layer + 1, n_embd)
    logits = lens_logits(model, resid).astype(np.float64)  # (n_layer + 1, n_vocab)
    k = min(top_k, logits.shape[1])
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    tok = model.tokenizer
    res = LensResult(tokens=[tok.piece(i) for i in ids], position=position % len(ids))
    for li, row in enumerate(logits):
        top = np.argsort(-row, kind="stable")[:k]
        res.rows.append(LensRow(layer="embed" if li == 0 else li - 1, ids=[int(i) for i in top],
                                pieces=[tok.piece(int(i)) for i in top], probs=[float(probs[li, i]) for i in top],
                                logits=[float(row[i]) for i in top]))
    return res


def attention_map(model, prompt: str | Sequence[int], layer: int) -> tuple[list[str], np.ndarray]:
    """(token pieces, attn_probs of block `layer` as (H, T, T)) for a text evaluated from an empty cache."""
    n_layer = model.args.n_layer
    if not 0 <= layer < n_layer:
        raise QllamaError(f"layer {layer} is outside the model's {n_layer} blocks (0..{n_layer - 1})")
    ids = _ids(model, prompt)
    with model.trace(capture=f"blk.{layer}.attn_probs") as t:
        model.logits(ids)
    probs = t[f"blk.{layer}.attn_probs"]  # (T, H, T)
    return [model.tokenizer.piece(i) for i in ids], probs.transpose(1, 0, 2)


__all__ = ["LensRow", "LensResult", "logit_lens", "lens_logits", "attention_map"]
