"""End to end: `qllama run` and the Python API on a synthetic model (always) and on the trained
reference model (when ../shared is present)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, shared_path
from tools.make_model import ModelSpec, write_model


def cli(*args, stdin=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "qllama", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("e2e") / "tiny.gguf"
    stored = write_model(path, ModelSpec(n_head=4, n_head_kv=2, weight_type="q8_0", seed=11, n_ctx=64))
    return path, stored


def test_api_greedy_generation_follows_the_reference_forward(tiny):
    """Greedy ids from qllama equal the argmax chain of the float64 reference forward pass."""
    import qllama
    from test_model import reference_logits

    path, stored = tiny
    model = qllama.load(path)
    prompt = model.tokenize("the cat")
    assert prompt[0] == model.tokenizer.bos_id
    chunks = list(model.stream(prompt, max_tokens=8, temperature=0.0))
    got = [t for c in chunks for t in c.token_ids]
    ids = list(prompt)
    for _ in range(len(got)):
        ids.append(int(np.argmax(reference_logits(stored, model.args, ids)[-1])))
    assert got == ids[len(prompt):]
    assert model.complete(prompt, max_tokens=8, temperature=0.0) == "".join(c.text for c in chunks)


def test_api_logits_does_not_disturb_generation(tiny):
    import qllama

    model = qllama.load(tiny[0])
    ids = model.tokenize("hello there")
    lg1 = model.logits(ids)
    gen = model.stream(ids, max_tokens=4, temperature=0.0)
    first = next(gen)
    lg2 = model.logits(ids)  # a fresh cache of its own
    rest = list(gen)
    np.testing.assert_array_equal(lg1, lg2)
    assert lg1.shape == (len(ids), model.n_vocab) and lg1.dtype == np.float32
    assert rest[-1].finish_reason is not None and first is not None


def test_cli_run_streams_the_same_text_as_the_api(tiny):
    import qllama

    path, _ = tiny
    expected = qllama.load(path).complete("the cat", max_tokens=12, temperature=0.0)
    r = cli("run", str(path), "the cat", "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"
    assert "prompt eval time" in r.stderr and "tokens per second" in r.stderr
    # the same prompt from stdin and from a file
    r2 = cli("run", str(path), "-n", "12", "--temp", "0", stdin="the cat")
    assert r2.stdout == r.stdout


def test_cli_seed_reproduces_sampled_text(tiny):
    path, _ = tiny
    a = cli("run", str(path), "the", "-n", "10", "--seed", "7", "--temp", "1.0")
    b = cli("run", str(path), "the", "-n", "10", "--seed", "7", "--temp", "1.0")
    assert a.returncode == 0 and a.stdout == b.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "/nonexistent/model.gguf", "hi"], "no such file"),
        (["run", __file__, "hi"], "not a GGUF file"),
    ],
)
def test_cli_run_errors_are_one_line(args, message):
    r = cli(*args)
    assert r.returncode == 1
    assert r.stderr.startswith("error:") and message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_run_rejects_unsupported_architecture(tmp_path):
    import gguf

    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_uint32("gpt2.context_length", 8)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    r = cli("run", str(p), "hi")
    assert r.returncode == 1 and r.stderr.startswith("error:") and "'gpt2'" in r.stderr


def test_cli_prompt_longer_than_context(tiny):
    r = cli("run", str(tiny[0]), "the cat " * 40, "-c", "16", "-n", "4")
    assert r.returncode == 1 and "error:" in r.stderr and "16" in r.stderr


def test_cli_bad_option_is_a_usage_error(tiny):
    r = cli("run", str(tiny[0]), "x", "--top-p", "2")
    assert r.returncode == 2 and r.stderr.startswith("error:")


def test_cli_run_on_trained_model_matches_llama_cpp():
    model = shared_path("models", "shakespeare-spm-Q4_K_M.gguf")
    ref = json.loads(shared_path("models", "shakespeare-spm-Q4_K_M.reference.json").read_text())
    case = ref["greedy"]["cases"][0]  # "ROMEO:"; first margin below 0.1 is at step 6
    r = cli("run", str(model), case["prompt"], "-n", "6", "--temp", "0")
    assert r.returncode == 0, r.stderr
    import qllama as q

    expected = q.load(model).detokenize(case["greedy_tokens"][:6])
    assert r.stdout == expected + "\n"


def test_generated_text_keeps_the_leading_space_of_its_first_token():
    """SPM: a continuation that starts with '▁word' prints ' word' (llama.cpp strips the space
    only at the start of a whole text)."""
    import qllama

    model = qllama.load(shared_path("models", "shakespeare-spm-Q4_K_M.gguf"), n_ctx=64)
    prompt = model.tokenize("ROMEO:\nO")
    the = model.tokenize("the", add_bos=False)  # the dummy prefix makes it "▁the"
    assert len(the) == 1 and model.tokenizer.token_bytes(the[0]) == b" the"
    from qllama.generation.session import stream_generate

    class ForceThe:  # a sampler that always picks "▁the"
        def accept(self, t):
            pass

        def sample(self, logits):
            return the[0]

    chunks = list(stream_generate(model.session, model.tokenizer, prompt, ForceThe(), max_tokens=2))
    assert "".join(c.text for c in chunks) == " the the"


def test_ctrl_c_stops_generation_and_still_prints_timings(tmp_path):
    """SIGINT (what Ctrl-C sends) mid-generation: clean stop, timings printed, exit status 130 (as llama-cli).

    A random model may sample its EOS and finish before the signal lands; such a run proves
    nothing, so the test tries a few seeds and needs one run that was really interrupted."""
    import signal
    import time

    path = tmp_path / "long.gguf"
    write_model(path, ModelSpec(n_ctx=16384, seed=3))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for seed in range(10):
        proc = subprocess.Popen([sys.executable, "-m", "qllama", "run", str(path), "the", "-n", "100000", "--temp", "1",
                                 "--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert proc.stdout.read(1)  # generation has started
        time.sleep(0.02)  # (a fast host finishes a tiny vocab's run within 0.2 s)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        err = err.decode()
        if "stopped: interrupted" not in err:
            continue  # it had already finished (sampled EOS) when the signal came
        assert proc.returncode == 130, err
        assert "prompt eval time" in err and "eval time" in err and "Traceback" not in err
        return
    pytest.fail("no run was still generating when SIGINT arrived")


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    """A tensor of a type we cannot execute (q4_0_4_4, repacked q4_0, here) fails at load, naming tensor and type;
    `inspect` still reads the file."""
    import struct

    path = tmp_path / "iq.gguf"
    write_model(path, ModelSpec(weight_type="q4_0", seed=4))
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == 2  # q4_0: 18-byte blocks of 32, like q4_0_4_4
    struct.pack_into("<I", data, type_at, 31)  # q4_0_4_4
    path.write_bytes(bytes(data))
    r = cli("run", str(path), "hi")
    assert r.returncode == 1 and r.stderr.startswith("error:")
    assert "blk.0.ffn_up.weight" in r.stderr and "q4_0_4_4" in r.stderr and "cannot run" in r.stderr
    r = cli("inspect", str(path))
    assert r.returncode == 0 and "q4_0_4_4" in r.stdout
