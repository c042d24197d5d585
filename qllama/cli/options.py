"""Options and input handling shared by several commands."""

from __future__ import annotations

import re
import sys

import click

from ..errors import QllamaError
from .model_ref import ModelRef

THREADS_HELP = ("Threads (default: adapted to how busy the machine is, for prompts and decoding alike: at most "
                "the physical cores, fewer when other processes hold cores). An explicit -t N is kept.")
RANDOM_SEED = -1  # llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF, i.e. -1): draw a random seed


def _seed(ctx, param, value: int | None) -> int | None:
    """--seed -1 means a random seed, as in llama.cpp; other negative seeds are errors."""
    if value is None or value == RANDOM_SEED:
        return None
    if value < 0:
        raise click.BadParameter(f"{value} is not a seed: use a number >= 0, or -1 for a random one")
    return value


_BIAS = re.compile(r"^\s*(\d+)\s*([+-])\s*(inf|infinity|\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)\s*$", re.I)


def parse_logit_bias(values) -> dict[int, float]:
    """llama.cpp's --logit-bias TOKEN_ID(+|-)BIAS (e.g. 15043+1, 15043-0.5, 2-inf), repeatable;
    biases given twice for one token add up, as llama.cpp's logit-bias sampler adds each entry."""
    out: dict[int, float] = {}
    for v in values or ():
        m = _BIAS.match(v)
        if not m:
            raise click.BadParameter(f"{v!r} is not TOKEN_ID(+|-)BIAS (e.g. 15043+1 or 15043-inf)",
                                     param_hint="'--logit-bias'")
        bias = float(m.group(3)) * (-1.0 if m.group(2) == "-" else 1.0)
        if bias == float("inf"):
            raise click.BadParameter(f"{v!r}: a bias of +inf is not allowed (use -inf to ban a token)",
                                     param_hint="'--logit-bias'")
        tok = int(m.group(1))
        out[tok] = out.get(tok, 0.0) + bias
    return out


def _with(f, opts):
    """f decorated with the click options (or arguments) opts, in their order."""
    for opt in reversed(opts):
        f = opt(f)
    return f


def sampling_options(f):
    """--temp, --top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n, --presence-penalty,
    --frequency-penalty, --logit-bias, --ignore-eos, -s/--seed (llama.cpp's defaults)."""
    opts = [
        click.option("--temp", default=0.8, show_default=True, type=float, help="Temperature; 0 = greedy."),
        click.option("--top-k", default=40, show_default=True, type=int, help="Top-k (<= 0: off)."),
        click.option("--top-p", default=0.95, show_default=True, type=click.FloatRange(0.0, 1.0), help="Top-p (1.0: off)."),
        click.option("--min-p", default=0.05, show_default=True, type=click.FloatRange(0.0, 1.0), help="Min-p (0.0: off)."),
        click.option("--repeat-penalty", default=1.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
                     help="Penalty for recently seen tokens (1.0: off)."),
        click.option("--repeat-last-n", default=64, show_default=True, type=click.IntRange(min=-1),
                     help="Window of the repeat penalty (0: off, -1: whole context)."),
        click.option("--presence-penalty", default=0.0, show_default=True, type=float,
                     help="Subtracted from every token seen in the repeat window (0.0: off)."),
        click.option("--frequency-penalty", default=0.0, show_default=True, type=float,
                     help="Subtracted per occurrence in the repeat window (0.0: off)."),
        click.option("--logit-bias", multiple=True, metavar="TOKEN_ID(+|-)BIAS", callback=lambda c, p, v: parse_logit_bias(v),
                     help="Add BIAS to a token's logit, e.g. 15043+1 or 2-inf (bans it); repeatable."),
        click.option("--ignore-eos", is_flag=True, help="Never end at an end-of-generation token (it is never sampled)."),
        click.option("-s", "--seed", type=int, default=None, callback=_seed,
                     help="Random seed (default or -1: a random one)."),
    ]
    return _with(f, opts)


# the KV cache types qllama runs, as llama.cpp's -ctk/-ctv: f16, f32 and the quantized ones
KV_CACHE_TYPES = ("f16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")


def kv_cache_options(f):
    """-ctk/--cache-type-k and -ctv/--cache-type-v (llama.cpp's flags): the KV cache's key and value
    types, f16 (the default, as llama.cpp's), f32 (twice the memory) or a quantized type (q8_0:
    1.0625 bytes per element, q4_0 0.5625, ...). The values reach the command as `type_k` and
    `type_v` (qllama.load's names)."""
    choice = click.Choice(KV_CACHE_TYPES, case_sensitive=False)
    opts = [
        click.option("-ctk", "--cache-type-k", "type_k", type=choice, default="f16", show_default=True,
                     help="KV cache type for K (f32: twice the memory; q8_0 .. iq4_nl: quantized blocks of 32)."),
        click.option("-ctv", "--cache-type-v", "type_v", type=choice, default="f16", show_default=True,
                     help="KV cache type for V (f32: twice the memory; q8_0 .. iq4_nl: quantized blocks of 32)."),
    ]
    return _with(f, opts)


def session_options(f):
    """-c/--ctx-size, -t/--threads, -b/--batch-size and the KV cache types (`kv_cache_options`) of
    the generating commands (run, chat)."""
    opts = [
        click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0, help="Context size (0 = min(model's, 4096))."),
        click.option("-t", "--threads", type=click.IntRange(min=1), help=THREADS_HELP),
        click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Prompt tokens per prefill batch."),
        kv_cache_options,
    ]
    return _with(f, opts)


def text_analysis_options(f):
    """MODEL and TEXT, --no-bos and -t/--threads of the analysis commands (lens, attention, experts)."""
    opts = [
        click.argument("model", type=ModelRef(dir_okay=False)),
        click.argument("text"),
        click.option("--no-bos", is_flag=True, help="Never add the BOS token."),
        click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: physical cores)."),
    ]
    return _with(f, opts)


def load_text(model, text: str, no_bos: bool, threads: int | None):
    """(model loaded for an analysis command, the tokens of TEXT: `text_ids`)."""
    from ..api import load

    llm = load(model, n_threads=threads)
    return llm, text_ids(llm, text, no_bos)


def read_text_file(path: str) -> str:
    """The UTF-8 text of `path`, or a one-line QllamaError ("nope.txt: no such file")."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise QllamaError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise QllamaError(f"{path}: is a directory") from None
    except PermissionError:
        raise QllamaError(f"{path}: permission denied") from None
    except UnicodeDecodeError:
        raise QllamaError(f"{path}: not UTF-8 text") from None


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from the argument, a file ('-' = stdin), or stdin when neither is given."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt either as an argument or with -f, not both")
    if prompt is not None:
        return prompt
    if prompt_file is not None and prompt_file != "-":
        return read_text_file(prompt_file)
    if prompt_file is None and sys.stdin.isatty():
        raise click.UsageError("no prompt: give PROMPT, -f FILE, or pipe text on stdin")
    return sys.stdin.read()


def text_ids(llm, text: str, no_bos: bool) -> list[int]:
    """The tokens of TEXT for an analysis command (lens, attention, experts): BOS as the model
    asks unless --no-bos, and a usage error when they do not fit in the context."""
    ids = llm.tokenize(text, add_bos=not no_bos)
    if len(ids) > llm.n_ctx:
        raise click.UsageError(f"the text has {len(ids)} tokens, more than the context of {llm.n_ctx}")
    return ids
