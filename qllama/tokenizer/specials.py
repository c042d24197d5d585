"""Special tokens as llama.cpp resolves them (llama_vocab::impl::load), in its order:

1. `model_defaults`: the per-model defaults (SPM: BOS 1, EOS 2, UNK 0, BOS added, space prefix;
   BPE: ids 11 and the pre-tokenizer's flags);
2. `read_specials`: the ids and flags the file sets, then the ones found by their text
   (end of turn, end of message, FIM), which also become control tokens;
3. the end-of-generation set: every token whose text ends a turn in some family
   (`<|eot_id|>`, `<|im_end|>`, `<|end|>`, `<end_of_turn>`, `<|endoftext|>`, `</s>`, `<eos>`...),
   FIM pad/repo/sep, and EOS, EOT and EOM, with llama.cpp's exceptions for gpt-oss/harmony;
4. `family_fixups`: attributes llama.cpp sets by model name (Phi-3 strips the spaces after
   special tokens; some Jina/BERT vocabularies strip the spaces before `<mask>`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QllamaError
from .pretokenizers import PreTokenizer
from .vocab import KEY, TokenAttr, Vocab, md_bool, md_token_id

# Texts llama.cpp recognizes. The first present one becomes eot/eom/fim; every token with one
# of them becomes a control token.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_LEGACY_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
# Every token with one of these texts ends generation (llama.cpp's special_eog_ids).
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: user-defined


@dataclass(frozen=True)
class _Defaults:
    bos: int | None
    eos: int | None
    unk: int | None
    add_bos: bool
    add_space_prefix: bool
    clean_spaces: bool


@dataclass(frozen=True)
class Specials:
    """The special ids and flags of one vocabulary (None: the model has no such token)."""

    bos: int | None
    eos: int | None
    unk: int | None
    eot: int | None  # end of turn
    eom: int | None  # end of message (tool call)
    fim: dict[str, int | None]  # fill-in-the-middle: fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool  # SPM: "▁" before the text and after every special token
    clean_spaces: bool  # the detokenizer's " ." -> "." clean-up
    eog: frozenset[int]  # generation ends on these


def model_defaults(model: str, pre: PreTokenizer | None) -> _Defaults:
    """llama.cpp's defaults for a tokenizer model (and BPE pre-tokenizer)."""
    if model == "llama":
        return _Defaults(bos=1, eos=2, unk=0, add_bos=True, add_space_prefix=True, clean_spaces=False)
    assert pre is not None
    bos = None if pre.name in ("glm4", "chatglm-bpe") else 11
    return _Defaults(bos=bos, eos=11, unk=None, add_bos=pre.add_bos, add_space_prefix=False,
                     clean_spaces=pre.clean_spaces)


def read_specials(md: dict, vocab: Vocab, d: _Defaults) -> Specials:
    """The special ids of the file and those found by text, and the end-of-generation set.

    Updates `vocab.attrs` as llama.cpp does: tokens found by text become control tokens,
    control tokens named "unused" become unused too.
    """
    n = vocab.n
    bos = md_token_id(md, "bos_token_id", d.bos, n)
    eos = md_token_id(md, "eos_token_id", d.eos, n)
    unk = md_token_id(md, "unknown_token_id", d.unk, n)
    fim = {}
    for k in _FIM_TEXTS:
        fim[k] = md_token_id(md, f"{k}_token_id", None, n)
        if k in _FIM_LEGACY_KEYS and md.get(KEY + f"{k}_token_id") is None:
            fim[k] = md_token_id(md, f"{_FIM_LEGACY_KEYS[k]}_token_id", None, n)
    add_bos = md_bool(md, KEY + "add_bos_token", d.add_bos)
    add_eos = md_bool(md, KEY + "add_eos_token", False)
    if add_bos and bos is None:
        raise QllamaError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
    if add_eos and eos is None:
        raise QllamaError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

    eot = _detect(vocab, md_token_id(md, "eot_token_id", None, n), _EOT_TEXTS)
    eom = _detect(vocab, md_token_id(md, "eom_token_id", None, n), _EOM_TEXTS)
    for k, texts in _FIM_TEXTS.items():
        fim[k] = _detect(vocab, fim[k], texts)
    for tid in np.flatnonzero(vocab.attrs & TokenAttr.CONTROL):
        if "unused" in vocab.tokens[tid]:
            vocab.attrs[tid] |= TokenAttr.UNUSED
    eog = _collect_eog(vocab, [fim["fim_pad"], fim["fim_rep"], fim["fim_sep"]], [eos, eot, eom])
    return Specials(bos, eos, unk, eot, eom, fim, add_bos, add_eos,
                    md_bool(md, KEY + "add_space_prefix", d.add_space_prefix), d.clean_spaces, eog)


def _detect(vocab: Vocab, current: int | None, texts: tuple[str, ...]) -> int | None:
    """`current` if the file set it (llama.cpp looks no further), else the first token with one
    of `texts` (llama.cpp takes the first its hash map yields; we take list order)."""
    if current is not None:
        return current
    for text in texts:
        tid = vocab.token_to_id.get(text)
        if tid is not None:
            vocab.attrs[tid] |= TokenAttr.CONTROL
            return tid
    return None


def _collect_eog(vocab: Vocab, fim_ends: list[int | None], ends: list[int | None]) -> frozenset[int]:
    """llama.cpp's special_eog_ids: FIM pad/repo/sep, tokens with an end text, EOS/EOT/EOM."""
    t2i, attrs = vocab.token_to_id, vocab.attrs
    eog = {t for t in fim_ends if t is not None}
    for text in EOG_TEXTS:
        tid = t2i.get(text)
        if tid is not None:
            eog.add(tid)
            attrs[tid] |= TokenAttr.CONTROL
    for text in _ALWAYS_SHOWN:
        tid = t2i.get(text)
        if tid is not None:
            attrs[tid] = TokenAttr.USER_DEFINED
    eog |= {t for t in ends if t is not None}
    texts = {vocab.tokens[t] for t in eog}
    calls = {"<|call|>", "<|calls|>"} & texts
    if "<|end|>" in texts and (("<|return|>" in texts and calls) or (calls and "<|flush|>" in texts)):
        end_id = t2i["<|end|>"]  # harmony / solar-open: <|end|> is not the end of generation there
        eog.discard(end_id)
        attrs[end_id] = TokenAttr.USER_DEFINED
    if "<|tool_response>" in texts and "</s>" in texts:
        s_id = t2i["</s>"]  # gemma 4: </s> is a normal token
        eog.discard(s_id)
        attrs[s_id] = TokenAttr.NORMAL
    return frozenset(int(t) for t in eog)


def family_fixups(md: dict, vocab: Vocab) -> None:
    """Token attributes llama.cpp sets by model name (in place)."""
    name = str(md.get("general.name", "")).lower()
    arch = str(md.get("general.architecture", ""))
    pre_name = str(md.get(KEY + "pre", ""))
    t2i, attrs = vocab.token_to_id, vocab.attrs
    if any(s in pre_name for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in t2i:
            attrs[t2i["<mask>"]] |= TokenAttr.LSTRIP
    elif "phi-3" in name or "phi3" in name:
        attrs[vocab.special_ids()] |= TokenAttr.RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if text in t2i:
                tid = t2i[text]
                attrs[tid] = (attrs[tid] | TokenAttr.RSTRIP) if on else (attrs[tid] & ~TokenAttr.RSTRIP)
