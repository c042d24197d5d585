"""How the scheduler reaches the model: `forward(segments)` over a loaded `qllama.Model`.

A segment is (token ids, KVCache): tokens at that cache's next positions. When the model
offers `forward_many` (one pass over the weights for all segments: the projections as one
mat-mat over every segment's tokens, attention per segment), a step costs about one decode;
otherwise the segments run one after another through `forward`, which gives the same logits.

A model loaded with the default thread count gets a `forward` that takes each step's count
(`forward(segments, n_threads)`) and carries `forward.threads`, a `StepThreads` that the
scheduler asks for that count (qllama/runtime/threads.py): so the server's steps adapt to a busy
machine as `run`'s decoding does. With an explicit count, `forward.threads` is None: fixed.
`forward.takes_prompt`: it takes `prompt=` (one flag per segment: the segment is a prompt's chunk,
`Model.forward`'s prompt), which the scheduler then passes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..runtime.threads import step_threads_for


def model_forward(llm) -> tuple[Callable[[Sequence[tuple]], list[np.ndarray]], Callable[[], object], bool]:
    """(forward, new_cache, batched) for a qllama.Model; forward returns each segment's last logits (n_vocab,)."""
    net = getattr(llm, "forward_model", None) or llm._model  # forward(ids, cache), new_cache()
    many = getattr(net, "forward_many", None)
    session = getattr(llm, "session", None)
    adaptive = getattr(session, "threads", None) is not None  # default threads (adapt_threads)
    threads = step_threads_for(net.n_threads) if adaptive else None
    if many is not None:
        def forward(segments, n_threads=None, prompt=False):
            return [np.asarray(lg)[-1] for lg in many(list(segments), n_threads=n_threads, prompt=prompt)]
        forward.threads, forward.takes_prompt = threads, True
        return forward, net.new_cache, True

    def forward_each(segments, n_threads=None, prompt=False):
        flags = [prompt] * len(segments) if isinstance(prompt, bool) else prompt
        return [net.forward(ids, cache, n_threads=n_threads, prompt=p)[-1] for (ids, cache), p in zip(segments, flags)]
    forward_each.threads, forward_each.takes_prompt = threads, True
    return forward_each, net.new_cache, False
