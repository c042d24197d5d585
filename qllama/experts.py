"""Expert usage of a mixture-of-experts model over a text, read from its router points.

    usage = expert_usage(model, "some text")       # a qllama.Model (or anything with trace/logits/tokenize)
    usage.counts                                    # (n_layer, n_expert) int: tokens routed to each expert
    usage.weights                                   # (n_layer, n_expert) float: their summed routing weights
    usage.top(layer, 5)                             # [(expert, count, share of the layer's picks)]
    usage.save_png("usage.png")                     # a heat map (matplotlib: the `qllama[plot]` extra)

The counts come from `blk.{i}.ffn_moe_experts` / `ffn_moe_weights` as the forward pass that
produces the tokens computes them (the int8 arithmetic included): every token of the text is
routed once per layer to `expert_used_count` experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import QllamaError


@dataclass
class ExpertUsage:
    counts: np.ndarray  # (n_layer, n_expert) int64: how many tokens chose each expert
    weights: np.ndarray  # (n_layer, n_expert) float64: the routing weights those choices carried
    n_tokens: int
    n_used: int  # experts per token

    def top(self, layer: int, n: int = 5) -> list[tuple[int, int, float]]:
        """The layer's n most chosen experts: (expert, tokens, share of the layer's n_tokens * n_used picks)."""
        row = self.counts[layer]
        order = np.argsort(-row, kind="stable")[:n]
        total = max(1, self.n_tokens * self.n_used)
        return [(int(e), int(row[e]), float(row[e]) / total) for e in order]

    def unused(self, layer: int) -> list[int]:
        """Experts no token chose in this layer."""
        return [int(e) for e in np.flatnonzero(self.counts[layer] == 0)]

    def as_dict(self) -> dict:
        return {"n_tokens": self.n_tokens, "n_used": self.n_used, "counts": self.counts.tolist(),
                "weights": self.weights.round(6).tolist()}

    def save_png(self, path: str, title: str = "expert usage") -> None:
        """A heat map of `counts` (layers down, experts across)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise QllamaError("a heat map needs matplotlib: pip install 'qllama[plot]'") from None
        n_layer, n_expert = self.counts.shape
        fig, ax = plt.subplots(figsize=(min(20, 2 + n_expert * 0.12), min(16, 1.5 + n_layer * 0.3)))
        im = ax.imshow(self.counts, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title(f"{title}: {self.n_tokens} tokens, {self.n_used} experts each")
        fig.colorbar(im, ax=ax, label="tokens")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def expert_usage(model, prompt: str | Sequence[int]) -> ExpertUsage:
    """Route a text (or token ids) through a mixture-of-experts model from an empty cache and count
    each layer's expert choices."""
    a = model.args
    if not a.n_expert:
        raise QllamaError(f"{a.arch} model has no experts (expert_count is 0)")
    ids = model.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not ids:
        raise QllamaError("the text has no tokens")
    counts = np.zeros((a.n_layer, a.n_expert), np.int64)
    weights = np.zeros((a.n_layer, a.n_expert), np.float64)
    with model.trace(capture=["blk.*.ffn_moe_experts", "blk.*.ffn_moe_weights"]) as t:
        model.logits(ids)
    for il in range(a.n_layer):
        ex = t[f"blk.{il}.ffn_moe_experts"].astype(np.int64)  # (T, k)
        w = t[f"blk.{il}.ffn_moe_weights"].astype(np.float64)  # (T, k)
        np.add.at(counts[il], ex.reshape(-1), 1)
        np.add.at(weights[il], ex.reshape(-1), w.reshape(-1))
    return ExpertUsage(counts, weights, len(ids), a.n_expert_used)


__all__ = ["ExpertUsage", "expert_usage"]
