"""SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`): Llama 2, TinyLlama, Mistral 7B,
Phi-3, Gemma 2/3.

llama.cpp's algorithm (llm_tokenizer_spm_session), on text whose spaces are already "▁":
start from single code points, and repeatedly merge the adjacent pair whose concatenation is a
token with the highest score (ties: the leftmost); a final symbol that is not a token becomes its
UTF-8 bytes as `<0xNN>` tokens (byte fallback).

Speed: merges never cross a point where a "▁" follows another character when no token has a
"▁" after a non-"▁" character (true of SentencePiece vocabularies, which split on whitespace;
checked per vocabulary). So the text is cut into words "▁▁word" that are encoded separately,
each once (a word cache), which gives exactly the whole-text result.
"""

from __future__ import annotations

import re

from .merge import encode_words, merge_symbols

SPACE = "\u2581"  # ▁, SentencePiece's visible space
_WORDS = re.compile(f"{SPACE}*[^{SPACE}]+|{SPACE}+")


class SPMModel:
    """Encodes one escaped fragment ("▁" for spaces) with a GGUF SPM vocabulary."""

    def __init__(self, tokens: list[str], token_to_id: dict[str, int], scores: list[float],
                 unk_id: int | None, add_space_prefix: bool = True):
        self._t2i = token_to_id
        self._unk = unk_id
        self.add_space_prefix = add_space_prefix
        # merge rank of a symbol pair = minus the score of the token it makes (lower wins)
        self._ranks = dict(zip(tokens, [-s for s in scores]))
        # byte fallback: <0xNN>, else the one-byte token itself (llama_vocab::byte_to_token)
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = token_to_id.get(f"<0x{b:02X}>")
            if tid is None:
                tid = token_to_id.get(chr(b)) if b < 0x80 else None
            self._byte_ids.append(tid)
        self.word_split = not any(SPACE in t.lstrip(SPACE) for t in tokens)
        self.cache: dict[str, list[int]] = {}

    def encode_fragment(self, text: str, after_special: bool) -> list[int]:
        """Token ids of raw text between special tokens (llama.cpp's SPM branch of llama_tokenize):
        the dummy-prefix space when `add_space_prefix` and the fragment starts the text or follows a
        special token, then spaces as "▁"."""
        if self.add_space_prefix and after_special:
            text = " " + text
        return self.encode(text.replace(" ", SPACE))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (already escaped with "▁")."""
        if not text:
            return []
        if not self.word_split:
            return self._encode(text)
        return encode_words(_WORDS.findall(text), self.cache, self._encode)

    def _encode(self, text: str) -> list[int]:
        t2i = self._t2i
        tid = t2i.get(text)
        if tid is not None and len(text) == 1:
            return [tid]
        out: list[int] = []
        for s in merge_symbols(list(text), self._ranks, by_pair=False):  # one symbol per code point
            tid = t2i.get(s)
            if tid is not None:
                out.append(tid)
                continue
            for byte in s.encode("utf-8", "surrogatepass"):
                bid = self._byte_ids[byte]
                if bid is None:
                    bid = self._unk  # llama.cpp throws here; we emit <unk> (or nothing without one)
                if bid is not None:
                    out.append(bid)
        return out

    def clear_cache(self) -> None:
        """Forget the encoded words (benchmarks start each run from an empty cache)."""
        self.cache.clear()
