"""The logit lens and attention maps (qllama.lens, `qllama lens`, `qllama attention`).

The lens of every layer is checked against the float64 reference (tests/reference_forward.py):
its residual stream after block i, through the reference's final norm, output matrix and
softcap. The last block's lens is the model's own prediction.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import qllama
from qllama.cli import cli
from reference_forward import Reference, rmsnorm
from tools.make_model import family_spec, write_model


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Final softcap 3 and attention softcap 2 (they change the result), window 8."""
    path = tmp_path_factory.mktemp("lens") / "gemma2.gguf"
    write_model(path, family_spec("gemma2", n_layer=3, n_head_kv=2, head_dim=32, sliding_window=8, attn_softcap=2.0,
                                  final_softcap=3.0, seed=7, n_embd=64, n_ff=128, n_head=4))
    return str(path)


IDS = [5, 17, 3, 44, 9, 12, 30, 7, 21, 2, 60, 11]


def test_lens_matches_reference_per_layer(gemma2, float_path):
    model = qllama.load(gemma2, n_ctx=64)
    res = model.logit_lens(IDS, top_k=4, position=-3)
    assert [r.layer for r in res.rows] == ["embed", 0, 1, 2] and res.position == len(IDS) - 3
    ref = Reference(gemma2)
    resid: dict[str, np.ndarray] = {}
    ref.logits(IDS, hook=lambda n, a, il: resid.__setitem__(n, a) if n == "embed" or n.endswith(".resid") else None)
    h, w = ref.h, ref.w
    for row, name in zip(res.rows, ["embed", "blk.0.resid", "blk.1.resid", "blk.2.resid"]):
        x = rmsnorm(resid[name][res.position], w["output_norm.weight"], h.rms_eps)
        logits = x @ w["output.weight"].T
        logits = h.final_softcap * np.tanh(logits / h.final_softcap)
        top = np.argsort(-logits)[:4]
        assert row.ids == top.tolist(), name
        np.testing.assert_allclose(row.logits, logits[top], rtol=1e-4, atol=1e-4 * np.abs(logits).max())
        p = np.exp(logits - logits.max())
        np.testing.assert_allclose(row.probs, (p / p.sum())[top], rtol=1e-3)
    # the last block's lens is the model's prediction
    full = model.logits(IDS)[res.position]
    assert res.rows[-1].ids == np.argsort(-full)[:4].tolist()


def test_lens_rejects_bad_arguments(gemma2):
    model = qllama.load(gemma2, n_ctx=64)
    with pytest.raises(qllama.QllamaError, match="position"):
        model.logit_lens(IDS, position=len(IDS))
    with pytest.raises(qllama.QllamaError, match="top_k"):
        model.logit_lens(IDS, top_k=0)


def test_lens_cli_json_and_table(gemma2):
    res = CliRunner().invoke(cli, ["lens", gemma2, "hello world", "--json", "-k", "3", "-t", "1"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [row["layer"] for row in doc["layers"]] == ["embed", 0, 1, 2]
    assert all(len(row["top"]) == 3 for row in doc["layers"])
    probs = [t["prob"] for t in doc["layers"][-1]["top"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    res = CliRunner().invoke(cli, ["lens", gemma2, "hello world", "-k", "2", "-t", "1"])
    assert res.exit_code == 0, res.output
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| ")]
    assert rows[0] == "| layer | top 1 | top 2 |" and len(rows) == 2 + 4  # header, rule, embed + 3 blocks


def test_attention_cli_heatmap(gemma2, tmp_path):
    model = qllama.load(gemma2, n_ctx=64)
    ids = model.tokenize("hello world again")
    from qllama.lens import attention_map

    pieces, probs = attention_map(model, ids, 1)
    assert probs.shape == (model.args.n_head, len(ids), len(ids))
    np.testing.assert_allclose(probs.sum(axis=2), 1.0, rtol=1e-5)
    res = CliRunner().invoke(cli, ["attention", gemma2, "hello world again", "--layer", "1", "--head", "0", "-t", "1"])
    assert res.exit_code == 0, res.output
    rows = [ln for ln in res.stdout.splitlines() if ln.rstrip().endswith("|") and ln[:5].strip().isdigit()]
    assert len(rows) == len(ids)
    # row i shows the head-0 weights: the first query attends to itself only (a full block)
    assert rows[0].split("|")[1].startswith("██")


def test_attention_cli_png(gemma2, tmp_path):
    pytest.importorskip("matplotlib", reason="--png needs the [plot] extra (test_attention_png_without_matplotlib covers its absence)")
    png = tmp_path / "map.png"
    res = CliRunner().invoke(cli, ["attention", gemma2, "hello world again", "--layer", "1", "--head", "0",
                                   "-t", "1", "--png", str(png)])
    assert res.exit_code == 0, res.output
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,msg", [(["--layer", "3"], "--layer"), (["--layer", "0", "--head", "4"], "--head")])
def test_attention_cli_bad_layer_or_head(gemma2, args, msg):
    res = CliRunner().invoke(cli, ["attention", gemma2, "hi", "-t", "1", *args])
    assert res.exit_code != 0 and msg in res.output


def test_attention_png_without_matplotlib(gemma2, tmp_path, monkeypatch):
    from qllama.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        main(["attention", gemma2, "hi", "--layer", "0", "--png", str(tmp_path / "x.png")])
    assert e.value.code == 1
