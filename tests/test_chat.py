"""Chat templates: real templates against their documented formats, built-ins, selection from
metadata, BOS exactly once, Hugging Face conventions, and the sandbox (escapes and limits).

Expected prompt strings are written by hand from each model card's documented format.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qllama.chat import (
    BUILTIN_ALIASES,
    BUILTIN_TEMPLATES,
    ChatTemplate,
    RenderLimits,
    TemplateError,
    alternative_template_names,
    builtin_template_name,
    strip_leading_bos,
)
from qllama.chat.sandbox import _check_jinja2_version
from qllama.errors import QllamaError

SHARED = Path(__file__).parents[2] / "shared"
REPO = Path(__file__).parents[1]

SYSTEM = "You are a helpful assistant."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]
PINNED = datetime(2024, 9, 5, 12, 0, 0)  # the clock strftime_now sees in these tests


def shared_template(name: str) -> str:
    p = SHARED / "templates" / name
    if not p.exists():
        pytest.skip(f"{p} is absent (the read-only ../shared folder is not beside this checkout)")
    return p.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Real templates (../shared/templates) against the documented formats
# ----------------------------------------------------------------------------------------------

# Qwen2.5 model card: ChatML; a default system prompt when none is given.
QWEN_EXPECTED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n"
    "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# Llama 3.1/3.2 prompt format: BOS, header-wrapped turns ending in <|eot_id|>; the system turn
# always begins with the knowledge-cutoff and today's date lines.
def llama3_expected(today: str) -> str:
    return (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\n"
        f"Today Date: {today}\n\n"
        "You are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThe capital of France is Paris.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# Phi-3.5-mini model card: <|role|>\n...<|end|>\n, then <|assistant|>\n.
PHI35_EXPECTED = (
    "<|system|>\nYou are a helpful assistant.<|end|>\n"
    "<|user|>\nWhat is the capital of France?<|end|>\n"
    "<|assistant|>\nThe capital of France is Paris.<|end|>\n"
    "<|user|>\nAnd of Italy?<|end|>\n"
    "<|assistant|>\n"
)


def test_qwen25_conversation():
    t = ChatTemplate(shared_template("Qwen-Qwen2.5-7B-Instruct.jinja"), "gguf")
    assert t.render(CONVERSATION, bos_token="", eos_token="<|im_end|>") == QWEN_EXPECTED


def test_qwen25_default_system_and_no_generation_prompt():
    t = ChatTemplate(shared_template("Qwen-Qwen2.5-7B-Instruct.jinja"), "gguf")
    out = t.render(CONVERSATION[1:2], add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )


def test_qwen25_tools_use_hf_tojson():
    """HF's tojson: json.dumps defaults (", " and ": "), non-ASCII kept, no HTML escaping."""
    t = ChatTemplate(shared_template("Qwen-Qwen2.5-7B-Instruct.jinja"), "gguf")
    tool = {"type": "function", "function": {"name": "météo", "description": "<b>weather</b> & more"}}
    out = t.render(CONVERSATION[1:2], tools=[tool])
    assert out.startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    )
    assert '\n<tools>\n{"type": "function", "function": {"name": "météo", "description": "<b>weather</b> & more"}}\n</tools>' in out


def test_llama31_conversation_fixed_date():
    # 3.1's template does not call strftime_now: its date is "26 Jul 2024" unless date_string is given
    t = ChatTemplate(shared_template("meta-llama-Llama-3.1-8B-Instruct.jinja"), "gguf", clock=lambda: PINNED)
    out = t.render(CONVERSATION, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert out == llama3_expected("26 Jul 2024")
    out = t.render(CONVERSATION, bos_token="<|begin_of_text|>", date_string="05 Sep 2024")
    assert out == llama3_expected("05 Sep 2024")


def test_llama32_conversation_uses_strftime_now():
    t = ChatTemplate(shared_template("meta-llama-Llama-3.2-3B-Instruct.jinja"), "gguf", clock=lambda: PINNED)
    out = t.render(CONVERSATION, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert out == llama3_expected("05 Sep 2024")


def test_llama32_default_clock_is_now():
    t = ChatTemplate(shared_template("meta-llama-Llama-3.2-3B-Instruct.jinja"), "gguf")
    before = datetime.now().strftime("%d %b %Y")
    out = t.render(CONVERSATION, bos_token="<|begin_of_text|>")
    after = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n" in out or f"Today Date: {after}\n" in out


def test_llama3_trims_content():
    t = ChatTemplate(shared_template("meta-llama-Llama-3.1-8B-Instruct.jinja"), "gguf")
    out = t.render([{"role": "user", "content": "  hi there \n"}], bos_token="<|begin_of_text|>")
    assert out.endswith("<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # no system message: the system turn holds only the date lines
    assert "Today Date: 26 Jul 2024\n\n<|eot_id|>" in out


def test_phi35_conversation():
    t = ChatTemplate(shared_template("microsoft-Phi-3.5-mini-instruct.jinja"), "gguf")
    assert t.render(CONVERSATION, bos_token="<s>", eos_token="<|endoftext|>") == PHI35_EXPECTED
    # without the generation prompt the template closes with EOS
    out = t.render(CONVERSATION, add_generation_prompt=False, eos_token="<|endoftext|>")
    assert out == PHI35_EXPECTED[: -len("<|assistant|>\n")] + "<|endoftext|>"


def test_every_shared_template_renders():
    d = SHARED / "templates"
    if not d.exists():
        pytest.skip(f"{d} is absent")
    files = sorted(d.glob("*.jinja"))
    assert len(files) >= 4
    for f in files:
        out = ChatTemplate(f.read_text(encoding="utf-8"), f"file:{f}", clock=lambda: PINNED).render(
            CONVERSATION, bos_token="<s>", eos_token="</s>"
        )
        for m in CONVERSATION:
            assert m["content"] in out, f.name


def test_guards_do_not_change_output_of_real_templates():
    """Differential check: our guarded sandbox and the stock Jinja sandbox agree."""
    d = SHARED / "templates"
    if not d.exists():
        pytest.skip(f"{d} is absent")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["strftime_now"] = lambda fmt: PINNED.strftime(fmt)
    for f in sorted(d.glob("*.jinja")):
        src = f.read_text(encoding="utf-8")
        for agp in (True, False):
            ours = ChatTemplate(src, "x", clock=lambda: PINNED).render(CONVERSATION, agp, "<s>", "</s>")
            stock = env.from_string(src).render(
                messages=CONVERSATION, add_generation_prompt=agp, bos_token="<s>", eos_token="</s>", tools=None
            )
            assert ours == stock, f.name


# ----------------------------------------------------------------------------------------------
# Built-in templates
# ----------------------------------------------------------------------------------------------

BUILTIN_EXPECTED = {
    # Meta's Llama-2-chat: [INST] <<SYS>>...<</SYS>> inside the first user turn; BOS per turn pair
    "llama-2": "<s>[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\nWhat is the capital of France? [/INST]"
    " The capital of France is Paris. </s><s>[INST] And of Italy? [/INST]",
    "llama-3": llama3_expected("")
    .replace("Cutting Knowledge Date: December 2023\nToday Date: \n\n", "")
    .replace("<|begin_of_text|>", "<s>"),
    "chatml": QWEN_EXPECTED,
    # Mistral Instruct: no system role, it opens the first user turn
    "mistral": "<s>[INST] You are a helpful assistant.\n\nWhat is the capital of France? [/INST]"
    " The capital of France is Paris.</s>[INST] And of Italy? [/INST]",
    "phi-3": PHI35_EXPECTED,
    # Gemma: no system role; the assistant is "model"
    "gemma": "<s><start_of_turn>user\nYou are a helpful assistant.\n\nWhat is the capital of France?<end_of_turn>\n"
    "<start_of_turn>model\nThe capital of France is Paris.<end_of_turn>\n"
    "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n",
    # Zephyr: <|role|>\n...</s>\n
    "zephyr": "<|system|>\nYou are a helpful assistant.</s>\n<|user|>\nWhat is the capital of France?</s>\n"
    "<|assistant|>\nThe capital of France is Paris.</s>\n<|user|>\nAnd of Italy?</s>\n<|assistant|>\n",
}


def test_llama3_builtin_expected_is_what_we_think():
    assert BUILTIN_EXPECTED["llama-3"] == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThe capital of France is Paris.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("family", sorted(BUILTIN_TEMPLATES))
def test_builtin_conversation(family):
    assert set(BUILTIN_EXPECTED) == set(BUILTIN_TEMPLATES)
    t = ChatTemplate.builtin(family)
    assert t.name == f"builtin:{family}"
    assert t.render(CONVERSATION, bos_token="<s>", eos_token="</s>") == BUILTIN_EXPECTED[family]


@pytest.mark.parametrize("family", ["llama-2", "mistral"])
def test_builtin_rejects_non_alternating_roles(family):
    with pytest.raises(TemplateError, match="alternate"):
        ChatTemplate.builtin(family).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_builtin_without_system_and_generation_prompt():
    msgs = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate.builtin("gemma").render(msgs, add_generation_prompt=False, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    )
    assert ChatTemplate.builtin("llama-2").render(msgs, bos_token="<s>") == "<s>[INST] Hi [/INST]"
    assert ChatTemplate.builtin("chatml").render(msgs, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_unknown_builtin():
    with pytest.raises(TemplateError, match="no built-in chat template 'vicuna'"):
        ChatTemplate.builtin("vicuna")


@pytest.mark.parametrize("alias, family", sorted(BUILTIN_ALIASES.items()))
def test_llama_cpp_names_are_aliases(alias, family):
    assert ChatTemplate.builtin(alias).name == f"builtin:{family}"
    assert ChatTemplate.from_spec(alias).source == BUILTIN_TEMPLATES[family]


def test_from_spec_takes_a_builtin_name_or_a_file(tmp_path, monkeypatch):
    for family in BUILTIN_TEMPLATES:
        assert ChatTemplate.from_spec(family).name == f"builtin:{family}"
    f = tmp_path / "t.jinja"
    f.write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    for spec in (str(f), f):
        t = ChatTemplate.from_spec(spec)
        assert (t.name, t.render([{"role": "user", "content": "x"}])) == (f"file:{f}", "FILE x")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chatml").write_text("a file named like a built-in")
    assert ChatTemplate.from_spec("chatml").name == "builtin:chatml"  # the name wins
    assert ChatTemplate.from_spec("./chatml").name == "file:chatml"
    assert ChatTemplate.from_spec(Path("chatml")).name == "file:chatml"  # a Path is always a file


@pytest.mark.parametrize("spec, message", [
    ("vicuna", "unknown chat template 'vicuna': neither a built-in name nor a file"),
    ("missing.jinja", "no such chat template file: missing.jinja"),
    ("dir/missing", "no such chat template file: dir/missing"),
])
def test_from_spec_errors_list_the_builtin_names(spec, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TemplateError) as e:
        ChatTemplate.from_spec(spec)
    text = str(e.value)
    assert text.startswith(message) and "\n" not in text
    assert text.endswith("(built-in names: llama-2, llama-3, chatml, mistral, phi-3, gemma, zephyr, llama2, llama3, phi3)")


# ----------------------------------------------------------------------------------------------
# Choosing a template from metadata
# ----------------------------------------------------------------------------------------------

SPM_VOCAB = ["<unk>", "<s>", "</s>", "▁the", "▁a"]


@pytest.mark.parametrize(
    "extra_tokens, family",
    [
        (["<|im_start|>", "<|im_end|>"], "chatml"),
        (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "llama-3"),
        (["<bos>", "<start_of_turn>", "<end_of_turn>"], "gemma"),
        (["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "phi-3"),
        (["[INST]", "[/INST]"], "mistral"),
    ],
)
def test_builtin_from_vocab_tokens(extra_tokens, family):
    md = {"general.architecture": "llama", "tokenizer.ggml.tokens": SPM_VOCAB + extra_tokens}
    assert builtin_template_name(md) == family
    # issue 12.6: only a hint; the prompt format follows the file, which has no template
    assert ChatTemplate.from_metadata(md) is None


@pytest.mark.parametrize(
    "md, family",
    [
        ({"general.name": "zephyr-7b-beta"}, "zephyr"),
        ({"general.name": "Mistral-7B-Instruct-v0.2"}, "mistral"),
        ({"general.name": "Llama-2-7b-chat-hf"}, "llama-2"),
        ({"general.architecture": "gemma2", "general.name": "gemma-2-2b-it"}, "gemma"),
        ({"general.architecture": "qwen2", "general.finetune": "Instruct"}, "chatml"),
        ({"general.architecture": "phi3", "general.name": "Phi 3 Mini Instruct"}, "phi-3"),
        ({"general.architecture": "llama", "tokenizer.ggml.pre": "llama-bpe", "general.name": "Chat model"}, "llama-3"),
        # no instruct hint: a base model with the same architecture gets no template
        ({"general.architecture": "qwen2"}, None),
        ({"general.name": "Llama-2-7b-hf"}, None),
        ({"general.name": "Mistral-7B-v0.1"}, None),
        # a name that says base vetoes even chat tokens in the vocabulary
        ({"general.name": "Qwen2.5 7B", "general.finetune": "base", "tokenizer.ggml.tokens": ["<|im_start|>", "<|im_end|>"]}, None),
    ],
)
def test_builtin_from_names(md, family):
    md = {"tokenizer.ggml.tokens": SPM_VOCAB, **md}
    assert builtin_template_name(md) == family


def test_base_model_from_shared_gguf_has_no_template():
    from qllama.gguf.reader import GGUFFile

    p = SHARED / "models" / "shakespeare-spm-Q4_K_M.gguf"
    if not p.exists():
        pytest.skip(f"{p} is absent")
    md = GGUFFile(p).metadata
    assert builtin_template_name(md) is None
    assert ChatTemplate.from_metadata(md) is None


def test_llama3_vocab_from_shared_gguf_has_no_template_but_a_llama3_hint():
    """Every Llama 3 base model's vocabulary has the chat tokens: they do not make it a chat model."""
    from qllama.gguf.reader import GGUFFile

    p = SHARED / "vocab" / "ggml-vocab-llama-bpe.gguf"
    if not p.exists():
        pytest.skip(f"{p} is absent")
    md = GGUFFile(p).metadata
    assert ChatTemplate.from_metadata(md) is None
    assert builtin_template_name(md) == "llama-3"


def test_from_metadata_precedence(tmp_path):
    md = {
        "tokenizer.ggml.tokens": SPM_VOCAB + ["<|im_start|>", "<|im_end|>"],
        "tokenizer.chat_template": "GGUF {{ messages[0].content }}",
        "tokenizer.chat_template.tool_use": "TOOLS {{ messages[0].content }}",
        "tokenizer.chat_template.rag": "RAG",
        "tokenizer.chat_templates": ["tool_use", "rag"],
    }
    msgs = [{"role": "user", "content": "x"}]
    t = ChatTemplate.from_metadata(md)
    assert (t.name, t.render(msgs)) == ("gguf", "GGUF x")
    t = ChatTemplate.from_metadata(md, name="tool_use")
    assert (t.name, t.render(msgs)) == ("gguf:tool_use", "TOOLS x")
    assert ChatTemplate.from_metadata(md, name="default").name == "gguf"
    assert ChatTemplate.from_metadata(md, name="builtin:zephyr").name == "builtin:zephyr"
    f = tmp_path / "t.jinja"
    f.write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    t = ChatTemplate.from_metadata(md, override_path=str(f), name="tool_use")
    assert (t.name, t.render(msgs)) == (f"file:{f}", "FILE x")
    # without the GGUF template there is none, whatever the vocabulary (issue 12.6)
    del md["tokenizer.chat_template"]
    assert ChatTemplate.from_metadata(md) is None
    assert alternative_template_names(md) == ["rag", "tool_use"]


def test_from_metadata_errors(tmp_path):
    md = {"tokenizer.chat_template.tool_use": "x"}
    with pytest.raises(TemplateError, match="no chat template named 'rag'; it has: tool_use"):
        ChatTemplate.from_metadata(md, name="rag")
    with pytest.raises(TemplateError, match="no named templates"):
        ChatTemplate.from_metadata({}, name="rag")
    with pytest.raises(TemplateError, match="cannot read chat template file"):
        ChatTemplate.from_metadata({}, override_path=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(TemplateError, match="not UTF-8"):
        ChatTemplate.from_metadata({}, override_path=bad)
    with pytest.raises(TemplateError, match="not a string"):
        ChatTemplate.from_metadata({"tokenizer.chat_template": 42})
    assert issubclass(TemplateError, QllamaError)


def test_alternative_template_names_empty():
    assert alternative_template_names({"tokenizer.chat_template": "x"}) == []


# ----------------------------------------------------------------------------------------------
# BOS exactly once
# ----------------------------------------------------------------------------------------------


def test_strip_leading_bos():
    assert strip_leading_bos("<s>[INST] hi", "<s>") == ("[INST] hi", True)
    assert strip_leading_bos("[INST] hi <s>", "<s>") == ("[INST] hi <s>", False)
    assert strip_leading_bos("<s><s>x", "<s>") == ("<s>x", True)  # only one is ours to remove
    assert strip_leading_bos("<s>x", "") == ("<s>x", False)


def test_bos_once_with_real_template_and_tokenizer():
    """Rendered Llama 3.1 text begins with the BOS text; tokenized it yields exactly one BOS id."""
    tok_mod = pytest.importorskip("qllama.tokenizer", reason="qllama.tokenizer not available yet")
    src = shared_template("meta-llama-Llama-3.1-8B-Instruct.jinja")
    vocab = SHARED / "vocab" / "ggml-vocab-llama-bpe.gguf"
    if not vocab.exists():
        pytest.skip(f"{vocab} is absent")
    from qllama.gguf.reader import GGUFFile

    md = GGUFFile(vocab).metadata
    tok = tok_mod.Tokenizer.from_metadata(md)
    bos_text = md["tokenizer.ggml.tokens"][tok.bos_id]
    assert bos_text == "<|begin_of_text|>"
    text = ChatTemplate(src, "gguf").render(CONVERSATION, bos_token=bos_text)
    assert text.startswith(bos_text)
    rest, had_bos = strip_leading_bos(text, bos_text)
    assert had_bos
    ids = [tok.bos_id] + tok.encode(rest, add_bos=False, parse_special=True)
    assert ids.count(tok.bos_id) == 1
    eot = md["tokenizer.ggml.tokens"].index("<|eot_id|>")
    assert ids.count(eot) == 4  # special tokens were parsed, not spelled out


# ----------------------------------------------------------------------------------------------
# Hugging Face conventions
# ----------------------------------------------------------------------------------------------


def render(src: str, messages=None, **kw) -> str:
    return ChatTemplate(src, "test", clock=lambda: PINNED).render(messages or [], **kw)


def test_inputs_and_helpers():
    assert render("{{ add_generation_prompt }}|{{ bos_token }}|{{ eos_token }}|{{ tools is none }}",
                  add_generation_prompt=False, bos_token="B", eos_token="E") == "False|B|E|True"
    assert render("{{ strftime_now('%Y-%m-%d %H:%M') }}") == "2024-09-05 12:00"
    assert render("{{ messages[0].role }}/{{ messages[0]['content'] }}", [{"role": "user", "content": "c"}]) == "user/c"
    assert render("{{ messages[0].tool_calls is defined }}", [{"role": "user", "content": "c"}]) == "False"
    with pytest.raises(TemplateError, match="chat template test raised: Only user and assistant roles"):
        render("{{ raise_exception('Only user and assistant roles are supported!') }}")


def test_trim_and_lstrip_blocks():
    src = "A\n  {% if true %}\n  B\n  {% endif %}\nC"
    assert render(src) == "A\n  B\nC"  # as HF: the block lines vanish, the text line keeps its indent


def test_tojson_like_hf():
    assert render("{{ {'é': '<b>&'} | tojson }}") == '{"é": "<b>&"}'
    assert render("{{ [1, {'a': 2}] | tojson(indent=2) }}") == '[\n  1,\n  {\n    "a": 2\n  }\n]'
    assert render("{{ {'b': 1, 'a': 2} | tojson(separators=(',', ':'), sort_keys=true) }}") == '{"a":2,"b":1}'
    assert render("{{ 'é' | tojson(ensure_ascii=true) }}") == '"\\u00e9"'


def test_loopcontrols_and_generation_tag():
    assert render("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "02"
    assert render("a{% generation %}b{% endgeneration %}c") == "abc"


BENIGN = [
    "{% for m in messages %}{{ loop.index }}:{{ m.role }}{{ ',' if not loop.last }}{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ loop.length }}{{ m.content|upper }}{% else %}none{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}{% endfor %}{{ ns.n }}",
    "{% macro turn(r, c) %}<{{ r }}>{{ c|trim }}</{{ r }}>{% endmacro %}{% for m in messages %}{{ turn(m.role, m.content) }}{% endfor %}",
    "{{ messages|map(attribute='role')|join('|') }} {{ messages|selectattr('role', 'equalto', 'user')|list|length }}",
    "{% set x %}{{ 'a' ~ 1 ~ none }}{% endset %}{{ x }} {{ '%s-%03d' % ('a', 7) }} {{ '{}/{:>4}'.format(1, 2) }}",
    "{{ (messages|first).content.split(' ')|reverse|join(' ') }} {{ 'x'.ljust(4, '.') }} {{ 'ab'.replace('a', 'zz') }}",
    "{{ 'a' * 3 }}{{ [1] * 2 }}{{ 2 ** 10 }}{{ [1] + [2] }}{{ 'x' + 'y' }}{{ range(3)|list }}{{ 7 % 3 }}",
    "{% for a, b in {'k': 'v'}|dictsort %}{{ a }}={{ b }}{% endfor %}{{ 'hello world'|title|center(15) }}|{{ 'a\nb'|indent(2, true) }}",
    "{% for i in range(3) recursive %}{{ i }}{% endfor %}{{ [[1, 2], [3]]|sum(start=[]) }}{{ [1,2,3]|batch(2)|list }}",
]


@pytest.mark.parametrize("src", BENIGN)
def test_guards_match_stock_sandbox_on_benign_templates(src):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    expected = env.from_string(src).render(messages=CONVERSATION)
    assert render(src, CONVERSATION) == expected


def test_bad_messages():
    t = ChatTemplate.builtin("chatml")
    for bad, msg in [("hi", "must be a list"), ([1], "must be a dict"), ([{"content": "x"}], "no 'role'"),
                     ([{"role": "user", "content": 3}], "'content' must be")]:
        with pytest.raises(TemplateError, match=msg):
            t.render(bad)


def test_syntax_and_runtime_errors_are_template_errors():
    with pytest.raises(TemplateError, match=r"chat template test has a syntax error at line 2"):
        ChatTemplate("ok\n{% for %}", "test")
    with pytest.raises(TemplateError, match="failed: .*no loader"):
        render("{% include 'other.jinja' %}")
    with pytest.raises(TemplateError, match="failed: ZeroDivisionError"):
        render("{{ 1 // 0 }}")
    with pytest.raises(TemplateError, match="2000 characters long .limit 1000."):
        ChatTemplate("x" * 2000, "test", limits=RenderLimits(max_source_chars=1000))


# ----------------------------------------------------------------------------------------------
# Security: sandbox escapes
# ----------------------------------------------------------------------------------------------

ESCAPES = {
    "class": "{{ ''.__class__ }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ raise_exception.__globals__ }}",
    "cycler_init": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "template_reference": "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "attr_filter": "{{ ''|attr('__class__') }}",
    "subscript": "{{ ''['__class__'] }}",
    "str_format_field": "{{ '{0.__class__.__mro__}'.format('') }}",
    "map_attribute": "{{ ['']|map(attribute='__class__')|list }}",
    "type_mro": "{{ dict.mro() }}",
    "mutate_messages": "{{ messages.append({'role': 'user'}) }}",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_sandbox_escape_is_blocked(name):
    with pytest.raises(TemplateError) as e:
        render(ESCAPES[name], [{"role": "user", "content": "x"}])
    msg = str(e.value)
    assert "\n" not in msg
    assert "blocked by the sandbox" in msg or "failed" in msg, msg


def test_unsafe_access_is_loud_not_silently_empty():
    """The stock sandbox renders `''.__class__` as ""; we refuse the template instead."""
    stock = ImmutableSandboxedEnvironment().from_string("[{{ ''.__class__ }}]").render()
    assert stock == "[]"
    with pytest.raises(TemplateError, match="'__class__' of a 'str' object is not allowed"):
        render("[{{ ''.__class__ }}]")


def test_cve_2024_34359_payload_executes_nothing(tmp_path):
    marker = tmp_path / "pwned"
    # the llama-cpp-python template-injection payload, aimed at a harmless marker file
    payload = (
        "{% for x in ().__class__.__base__.__subclasses__() %}{% if \"warning\" in x.__name__ %}"
        "{{ x()._module.__builtins__['__import__']('os').popen('touch " + str(marker) + "') }}"
        "{% endif %}{% endfor %}"
    )
    md = {"tokenizer.chat_template": payload}
    t = ChatTemplate.from_metadata(md)
    with pytest.raises(TemplateError, match="blocked by the sandbox: access to attribute '__class__'"):
        t.render([{"role": "user", "content": "hi"}])
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# Security: resource limits
# ----------------------------------------------------------------------------------------------

FAST = RenderLimits(timeout_s=0.3)

LIMITED = {
    # single huge operations: refused before they run
    "str_mul": ("{{ 'a' * 1000000000 }}", "repeated string"),
    "str_mul_reversed": ("{{ 1000000000 * 'a' }}", "repeated string"),
    "list_mul": ("{{ ['a'] * 1000000000 }}", "list of 1000000000 items"),
    "int_pow": ("{{ 10 ** (10 ** 10) }}", "integer power too large"),
    "ljust": ("{{ 'a'.ljust(1000000000) }}", "too large"),
    "center_filter": ("{{ 'a'|center(1000000000) }}", "too large"),
    "percent_width": ("{{ '%0999999999d' % 1 }}", "% formatted field"),
    "percent_star": ("{{ '%*d' % (999999, 1) }}", "'\\*' widths"),
    "format_width": ("{{ '{:>999999999}'.format(1) }}", "str.format field"),
    "format_nested": ("{{ '{:>{w}}'.format(1, w='99999') }}", "nested fields"),
    "format_reuse": ("{% set s = 'x' * 500000 %}{{ '{0}{0}{0}'.format(s) }}", "str.format result"),
    "join_filter": ("{% set s = 'x' * 400000 %}{{ (s, s, s)|join }}", "characters"),
    "join_method": ("{% set s = 'x' * 400000 %}{{ ''.join((s, s, s)) }}", "characters"),
    "join_generator": ("{{ range(3)|map('center', 400000)|join }}", "join\\(\\) result"),
    "replace_empty": ("{{ ('x' * 100000).replace('', 'yyyyyyyyyyyy') }}", "replace\\(\\) result"),
    "replace_filter": ("{{ ('x' * 100000)|replace('', 'yyyyyyyyyyyy') }}", "replace\\(\\) result"),
    "indent": ("{{ ('\n' * 100000)|indent(1000, true, true) }}", "indent\\(\\) result"),
    "tojson_indent": ("{{ [1]|tojson(indent=100000) }}", "indent 100000 is too large"),
    "expandtabs": ("{{ ('\t' * 100000).expandtabs(100000) }}", "expandtabs"),
    "to_bytes": ("{{ (1).to_bytes(1000000000, 'big') }}", "too large"),
    "range": ("{{ range(1000000000)|list }}", "too large"),
    "batch_fill": ("{{ [1]|batch(1000000000, 'x')|list }}", "too large"),
    "wordwrap_input": ("{{ ('a' * 1000000)|wordwrap(10) }}", "wordwrap of 1000000 characters"),
    "strftime_width": ("{{ strftime_now('%999999999Y') }}", "width 999999999 is too large"),
    # growth by doubling: each step is checked
    "plus_doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "concatenated string"),
    "tilde_doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "~ concatenation"),
    "int_squaring": ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "integer product"),
    "shared_list": ("{% set a = ['x' * 100000] * 10 %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ b }}", "output value"),
    # output size
    "output_stream": ("{% set s = 'x' * 900000 %}{% for i in range(100) %}{{ s }}{% endfor %}", "output exceeds"),
    "buffered_text": ("{% set s = 'x' * 900000 %}{% set big %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}", "produced more than"),
    "macro_buffer": ("{% macro f() %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}{% endmacro %}{{ f()|length }}", "produced more than|time limit"),
    # time
    "nested_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit of 0.3 s"),
    "string_loops": ("{% set s = 'x' * 100000 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}", "time limit"),
    "macro_fanout": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", "time limit"),
    "macro_recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
}


@pytest.mark.parametrize("name", sorted(LIMITED))
def test_limits_stop_hostile_templates(name):
    src, pattern = LIMITED[name]
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match=pattern) as e:
        ChatTemplate(src, "gguf", limits=FAST).render([{"role": "user", "content": "x"}])
    elapsed = time.perf_counter() - t0
    assert "\n" not in str(e.value)
    assert elapsed < 60.0, f"{name} took {elapsed:.1f} s to stop"  # a hang, not speed: loaded 2-core CI


def test_limits_are_configurable():
    src = "{{ 'a' * 2000 }}"
    assert len(render(src)) == 2000
    with pytest.raises(TemplateError, match="limit 1000"):
        ChatTemplate(src, "t", limits=RenderLimits(max_chars=1000)).render([])


def test_limit_applies_to_huge_messages_too():
    t = ChatTemplate.builtin("chatml", limits=RenderLimits(max_chars=10_000))
    with pytest.raises(TemplateError, match="limit 10000"):
        t.render([{"role": "user", "content": "x" * 20_000}])


# ----------------------------------------------------------------------------------------------
# Jinja2 version gate
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version, ok", [("3.1.6", True), ("3.1.7", True), ("3.2.0", True), ("4.0.0.dev1", True),
                                         ("3.1.5", False), ("3.1.4", False), ("3.0.3", False), ("2.11.3", False),
                                         ("garbage", False)])
def test_jinja2_version_gate(version, ok):
    if ok:
        _check_jinja2_version(version)
    else:
        with pytest.raises(TemplateError, match="jinja2>=3.1.6"):
            _check_jinja2_version(version)


def test_old_jinja2_refused_at_import():
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda n: '3.1.4' if n.lower() == 'jinja2' else real(n)\n"
        "import qllama.chat\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0
    assert "TemplateError: Jinja2 3.1.4 has known sandbox escapes" in r.stderr
