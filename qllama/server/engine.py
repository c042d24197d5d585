"""How the scheduler reaches the model: `forward(segments)` over a loaded `qllama.Model`.

A segment is (token ids, KVCache): tokens at that cache's next positions. When the model
offers `forward_many` (one pass over the weights for all segments: the projections as one
mat-mat over every segment's tokens, attention per segment), a step costs about one decode;
otherwise the segments run one after another through `forward`, which gives the same logits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def model_forward(llm) -> tuple[Callable[[Sequence[tuple]], list[np.ndarray]], Callable[[], object], bool]:
    """(forward, new_cache, batched) for a qllama.Model; forward returns each segment's last logits (n_vocab,)."""
    net = getattr(llm, "forward_model", None) or llm._model  # forward(ids, cache), new_cache()
    many = getattr(net, "forward_many", None)
    if many is not None:
        def forward(segments):
            return [np.asarray(lg)[-1] for lg in many(list(segments))]
        return forward, net.new_cache, True

    def forward_each(segments):
        return [net.forward(ids, cache)[-1] for ids, cache in segments]
    return forward_each, net.new_cache, False
