"""Tokenizers from GGUF metadata, giving llama.cpp's token ids (src/llama-vocab.cpp).

    from qllama.tokenizer import load_tokenizer
    tok = load_tokenizer("model.gguf")          # works on vocab-only files too
    ids = tok.encode("Hello", add_bos=True)
    text = tok.decode(ids)

Modules, in the order a tokenizer is built and used:
- `vocab`: the token table (texts, types -> attributes, scores, merges) read from the metadata;
- `specials`: BOS/EOS/UNK/EOT/EOM/FIM ids, the end-of-generation set, llama.cpp's fix-ups;
- `pretokenizers`: how BPE families split text into words before merging;
- `merge`: the word cache and merge loop that BPE and SPM share;
- `bpe`, `spm`: the two merge models (`gpt2` byte-level BPE, `llama` SentencePiece-style);
- `core`: `Tokenizer` (special-token partition, encode, decode);
- `stream`: `StreamDecoder` (token-by-token text) and the detokenizer's space clean-up.

Nothing here imports numba: `qllama tokenize` and `qllama inspect` stay light.
"""

from __future__ import annotations

from .core import Tokenizer, load_tokenizer
from .stream import StreamDecoder, clean_up_spaces
from .vocab import TokenAttr, TokenType

__all__ = ["Tokenizer", "StreamDecoder", "load_tokenizer", "TokenType", "TokenAttr", "clean_up_spaces"]
