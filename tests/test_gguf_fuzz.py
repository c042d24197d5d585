"""Mutation fuzzing of the GGUF reader (and of `qllama inspect`'s rendering on what it accepts).

At least 5,000 mutated and truncated files per default run, seeded (reproducible): the only
exception allowed is `GGUFError`; a file that parses must survive summary, text and JSON
rendering and tensor access. A hypothesis test adds shrinking on arbitrary byte edits.
"""

from __future__ import annotations

import json
import random
import struct
import time
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qllama.cli.inspect_cmd import render_json, render_text
from qllama.errors import GGUFError
from qllama.gguf.types import F16, F32, Q4_K, Q8_0
from qllama.gguf.reader import GGUFFile, ValueType
from qllama.report.summary import summarize

from test_gguf import ALL_TYPES_KVS, all_types_file, make_gguf  # noqa: E402  (tests/ is on sys.path)

VT = ValueType
N_MUTANTS = 5200
SHARED = Path(__file__).resolve().parents[2] / "shared"

# 8-byte values that hit the edges of counts, lengths, dims and offsets.
INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 31, 32, 33, 63, 64, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**42 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 32]


def _seed_files() -> list[bytes]:
    llama_kvs = [
        ("general.architecture", VT.STRING, "llama"), ("general.name", VT.STRING, "fuzz"),
        ("llama.block_count", VT.UINT32, 2), ("llama.embedding_length", VT.UINT32, 64),
        ("llama.attention.head_count", VT.UINT32, 4), ("llama.attention.head_count_kv", VT.UINT32, 2),
        ("llama.feed_forward_length", VT.ARRAY, (VT.INT32, [128, 96])),
        ("llama.rope.scaling.type", VT.STRING, "linear"), ("llama.rope.scaling.factor", VT.FLOAT32, 4.0),
        ("general.file_type", VT.UINT32, 15), ("tokenizer.ggml.model", VT.STRING, "gpt2"),
        ("tokenizer.ggml.tokens", VT.ARRAY, (VT.STRING, [f"t{i}" for i in range(70)] + [b"\xff\xfe", "\n"])),
        ("tokenizer.ggml.bos_token_id", VT.UINT32, 70), ("tokenizer.ggml.eos_token_id", VT.UINT32, 71),
        ("tokenizer.chat_template", VT.STRING, "{{ messages }}"),
        ("tokenizer.chat_template.tool_use", VT.STRING, "{{ tools }}"),
    ]
    tensors = [("token_embd.weight", (256, 4), Q4_K, None), ("output_norm.weight", (64,), F32, None),
               ("blk.0.attn_q.weight", (64, 64), Q8_0, None), ("rope_freqs.weight", (32,), F16, None),
               ("weird", (32, 2), 77, None)]
    seeds = [all_types_file(), make_gguf(llama_kvs, tensors), make_gguf(ALL_TYPES_KVS[:5])]
    spm = SHARED / "vocab" / "ggml-vocab-llama-spm.gguf"
    if spm.exists():  # a real file's first 40 KB: header, keys and the start of the tokens
        seeds.append(spm.read_bytes()[:40_000])
    return seeds


def mutate(rng: random.Random, blob: bytes, seeds: list[bytes]) -> bytes:
    b = bytearray(blob)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 6))):
        op = rng.randrange(8)
        if not b:
            b += b"GGUF"
        i = rng.randrange(len(b))
        if op == 0:  # flip random bits
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # a random byte
            b[i] = rng.randrange(256)
        elif op == 2:  # an interesting u64 / u32 at a random place (counts, lengths, dims, offsets)
            v = rng.choice(INTERESTING)
            w = struct.pack("<Q", v) if rng.random() < 0.7 else struct.pack("<I", v & 0xFFFFFFFF)
            b[i : i + len(w)] = w
        elif op == 3:  # truncate
            del b[rng.randrange(len(b) + 1) :]
        elif op == 4:  # delete a chunk
            del b[i : i + rng.randrange(1, 16)]
        elif op == 5:  # insert random bytes
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 6:  # duplicate a chunk
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randrange(1, 64)]
        else:  # splice with another seed
            other = rng.choice(seeds)
            j = rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[j:])
    return bytes(b)


def exercise(blob: bytes) -> bool:
    """Parse; on success use everything. Returns whether it parsed. Only GGUFError may escape."""
    try:
        f = GGUFFile.from_bytes(blob)
    except GGUFError as e:
        assert "\n" not in str(e)
        return False
    summarize(f)
    render_text(f, with_metadata=True)
    json.loads(render_json(f))
    for name, t in f.tensors.items():
        try:
            raw = f.tensor_bytes(name)
            assert raw.size == t.n_bytes
            f.tensor_array(name)
        except GGUFError:
            pass
    return True


def test_mutation_fuzz() -> None:
    rng = random.Random(20240527)
    seeds = _seed_files()
    for s in seeds[:3]:
        assert exercise(s)  # the seeds themselves are valid
    parsed = 0
    slowest = 0.0
    t_start = time.perf_counter()
    for i in range(N_MUTANTS):
        blob = mutate(rng, seeds[i % len(seeds)], seeds)
        t0 = time.perf_counter()
        try:
            parsed += exercise(blob)
        except Exception as e:  # report the reproducer, not just the exception
            raise AssertionError(f"mutant {i} raised {type(e).__name__}: {e}; blob={blob[:200]!r}...") from e
        slowest = max(slowest, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    # Some mutants must still parse (else we only fuzz the header check), most must not.
    assert 0.02 * N_MUTANTS < parsed < 0.9 * N_MUTANTS, parsed
    # hangs and runaway allocations, not speed (the bounds are generous for a loaded 2-core machine;
    # tools/bench_gguf_open.py measures the speed)
    assert slowest < 20.0, f"one file took {slowest:.2f} s"
    assert elapsed < 900, elapsed


def test_every_truncation_of_the_seeds() -> None:
    # each whole seed parses, and every proper prefix of it is refused (as a GGUFError)
    for seed in _seed_files()[:3]:
        assert exercise(seed)
        accepted = [cut for cut in range(len(seed)) if exercise(seed[:cut])]
        assert accepted == [], f"{len(accepted)} truncations of a {len(seed)}-byte seed parsed, e.g. {accepted[:5]}"


def test_fuzz_through_the_file_path(tmp_path: Path) -> None:
    # The mmap path (not only from_bytes): a few hundred mutants written to disk.
    rng = random.Random(7)
    seeds = _seed_files()
    p = tmp_path / "m.gguf"
    for i in range(300):
        blob = mutate(rng, seeds[i % len(seeds)], seeds)
        p.write_bytes(blob)
        try:
            with GGUFFile(p) as f:
                summarize(f)
                for name, t in f.tensors.items():
                    if t.n_bytes is not None:
                        assert f.tensor_bytes(name).size == t.n_bytes
        except GGUFError:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([0, 1]),
    st.lists(st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=8)), max_size=4),
    st.integers(0, 10_000),
)
def test_hypothesis_byte_edits(seed_index: int, edits: list[tuple[int, bytes]], cut: int) -> None:
    seed = bytearray(_SEEDS[seed_index])
    for pos, data in edits:
        pos %= len(seed)
        seed[pos : pos + len(data)] = data
    blob = bytes(seed[: max(cut, 0) % (len(seed) + 1)] if cut % 3 == 0 else seed)
    exercise(blob)


_SEEDS = _seed_files()[:2]


def test_numpy_views_survive_close() -> None:
    # Views taken before close() stay valid (the map is released only when they go).
    f = GGUFFile.from_bytes(all_types_file())
    arr = f.metadata["a.u8"]
    f.close()
    assert arr.tolist() == [1, 2, 3]
    assert isinstance(np.asarray(arr), np.ndarray)
