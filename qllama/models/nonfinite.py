"""Where a forward pass first produced NaN or Inf.

The fast path checks only the logits it returns (a pass over n_vocab floats per row). When a
row is not finite, the step is evaluated again on the same cache positions with every named
point captured (`points.Trace`), and the first point, in the order the model computes them,
whose values are not finite is named in the error. The checked re-run costs one slow step,
and only when something is already wrong.
"""

from __future__ import annotations

import numpy as np

from ..errors import NonFiniteError


def _bad(name: str, arr: np.ndarray) -> bool:
    if name.endswith("attn_scores"):  # masked positions are -inf by design
        return bool(np.isnan(arr).any() or np.isposinf(arr).any())
    return not bool(np.isfinite(arr).all())


def locate(model, tokens: np.ndarray, cache, start: int) -> NonFiniteError:
    """Re-run `tokens` at positions start.. of `cache` with every point captured; the error to raise."""
    from .points import Trace, probe_of

    cache.rewind(start)
    probe = probe_of(model)  # the user's hooks too: one of them may be what produced the NaN
    trace = Trace(probe, "*")
    probe.checks = False  # the re-run itself must not check (and re-run) again
    try:
        with trace:
            model.forward(tokens, cache, all_logits=True)
    finally:
        probe.checks = True
    where = next((name for name in trace.names() if any(_bad(name, a) for a in trace.calls(name))), None)
    span = f"position {start}" if len(tokens) == 1 else f"positions {start}..{start + len(tokens) - 1}"
    if where is None:  # the re-run was finite: not reproducible (a hook, or something outside the model)
        return NonFiniteError(f"the model produced non-finite logits (NaN or Inf) at {span}; "
                              "a checked re-run of that step did not reproduce it", None, None, start)
    layer = int(where.split(".")[1]) if where.startswith("blk.") else None
    return NonFiniteError(f"the model produced non-finite values (NaN or Inf) at {span}: "
                          f"first at {where}", where, layer, start)
