"""The `qllama` command line: a click group whose commands live one per module.

Commands are imported lazily, so that `qllama inspect` or `qllama tokenize` never pay for
importing numba. Every command module exposes a click command named `command`.
Errors that are the user's (QllamaError, a missing file...) become one `error:` line on
stderr and exit status 1; `--debug` shows the traceback instead. Ctrl-C exits with status
130 and no traceback, whenever it comes (see `main`).

Before click parses, `rewrite_argv` accepts llama.cpp's habits that click cannot express:
`-m/--model MODEL` in place of the positional MODEL, and GPU or memory-locking flags that mean
nothing here (`-ngl N`, `--n-gpu-layers N`, `--mlock`, `--no-mmap`: click would read `-ngl 99`
as `-n gl`), which are dropped with a one-line notice.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import warnings

import click

# command name -> module (relative to qllama.cli) that defines `command`
COMMANDS = {
    "inspect": "inspect_cmd",
    "run": "run_cmd",
    "tokenize": "tokenize_cmd",
    "perplexity": "perplexity_cmd",
    "bench": "bench_cmd",
    "quantize": "quantize_cmd",
    "chat": "chat_cmd",
    "serve": "serve_cmd",
    "pull": "pull_cmd",
    "list": "list_cmd",
    "rm": "rm_cmd",
    "version": "version_cmd",
    "lens": "lens_cmd",
    "attention": "attention_cmd",
    "experts": "experts_cmd",
    "batch": "batch_cmd",
}

FLASH_ATTN_VALUES = {"on", "off", "auto", "1", "0", "true", "false", "enabled", "disabled"}
FLASH_ATTN_NOTE = "qllama's attention is always one fused pass that never stores the score matrix, as flash attention"
# llama.cpp flags with no meaning on a CPU-only runtime: flag -> (takes a value, why it is ignored);
# a set of values: an optional value (taken when the next argument is one of them)
IGNORED_FLAGS = {
    "-fa": (FLASH_ATTN_VALUES, FLASH_ATTN_NOTE),
    "--flash-attn": (FLASH_ATTN_VALUES, FLASH_ATTN_NOTE),
    "-ngl": (True, "qllama runs on the CPU; there are no GPU layers"),
    "--n-gpu-layers": (True, "qllama runs on the CPU; there are no GPU layers"),
    "--gpu-layers": (True, "qllama runs on the CPU; there are no GPU layers"),
    "--mlock": (False, "the model stays memory-mapped; it is not locked in RAM"),
    "--no-mmap": (False, "qllama always memory-maps the model"),
}
# commands whose first argument is MODEL, so that `-m MODEL` may stand for it
MODEL_FIRST = {"run", "chat", "perplexity", "bench", "inspect", "tokenize", "serve", "lens", "attention", "batch", "experts"}
# llama.cpp spellings of options a command spells differently (where click cannot simply alias)
OPTION_ALIASES = {"chat": {"--n-predict": "--max-tokens"}}


def rewrite_argv(args: list[str]) -> tuple[list[str], list[str]]:
    """llama.cpp habits -> our arguments. Returns (new args, notices to print).

    - `-ngl N`, `--n-gpu-layers N`, `--mlock`, `--no-mmap` (also `--flag=value`) are removed;
    - `-m MODEL`, `--model MODEL`, `--model=MODEL` become the positional MODEL of the commands
      in MODEL_FIRST (moved right after the command name);
    - OPTION_ALIASES are renamed. Nothing after `--` is touched.
    """
    out: list[str] = []
    notices: list[str] = []
    command = None
    command_at = -1
    model = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out.extend(args[i:])
            break
        name, eq, _ = a.partition("=")
        if name in IGNORED_FLAGS:
            takes_value, why = IGNORED_FLAGS[name]
            if isinstance(takes_value, set):  # an optional value (llama.cpp's -fa [on|off|auto])
                value = a.partition("=")[2] if eq else (args[i + 1] if i + 1 < len(args) else "")
                if value.lower() not in takes_value:
                    if eq:
                        raise click.UsageError(f"{name} takes one of {', '.join(sorted(takes_value))}, got {value!r}")
                elif not eq:
                    i += 1
            elif takes_value and not eq:
                i += 1  # its value
            notices.append(f"note: {name} is accepted and ignored: {why}" if name in ("-fa", "--flash-attn")
                           else f"note: {name} is ignored ({why})")
            i += 1
            continue
        if command is None and not a.startswith("-"):
            command, command_at = a, len(out)
        elif command in MODEL_FIRST and model is None and name in ("-m", "--model"):
            if eq:
                model = a.partition("=")[2]
            elif i + 1 < len(args):
                model = args[i + 1]
                i += 1
            else:
                out.append(a)  # let click report the missing value
            i += 1
            continue
        elif command in OPTION_ALIASES and name in OPTION_ALIASES[command]:
            a = OPTION_ALIASES[command][name] + (eq + a.partition("=")[2] if eq else "")
        out.append(a)
        i += 1
    if model is not None:
        out.insert(command_at + 1, model)
    return out, notices


def check_single_dash(args: list[str], command: click.Command | None) -> None:
    """llama.cpp spells many options with one dash and several letters (-cnv, -sys, -ctk, -np):
    click would read an undeclared one as a cluster of short options (-cnv as -c nv). Every
    single-dash word of more than one letter must be an option the command declares (or a number,
    or an option's value); else a usage error names it."""
    if command is None:
        return
    takes_value: dict[str, bool] = {}
    for p in command.params:
        if isinstance(p, click.Option):
            for name in p.opts:
                takes_value[name] = not p.is_flag and not p.count
            for name in p.secondary_opts:
                takes_value[name] = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return
        name = a.partition("=")[0]
        if name in takes_value:
            if takes_value[name] and "=" not in a:
                i += 1  # its value, whatever it looks like (-n -1, -p "-x")
        elif a.startswith("-") and not a.startswith("--") and len(name) > 2:
            try:
                float(a)
            except ValueError:
                raise click.NoSuchOption(name, message=f"no such option: {name} (single-dash options of several "
                                         f"letters are never read as clusters of one-letter ones)") from None
        i += 1


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self.get_command(ctx, name) is not None)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMANDS.get(name)
        if module is None:
            return None
        try:
            return importlib.import_module(f"{__name__}.{module}").command
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(f"{__name__}."):
                return None  # a command not written yet
            raise


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from .version_cmd import version_text

    click.echo(version_text())
    ctx.exit(0)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="llama.cpp spellings work too: -m MODEL for the MODEL argument; -ngl, --mlock, --no-mmap and "
                    "-fa/--flash-attn [on|off|auto] are accepted and ignored (CPU only).")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the versions of qllama, Numba and NumPy and the SIMD path, then exit.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """qllama: run quantized GGUF language models on the CPU."""
    ctx.obj = {"debug": debug}
    if os.environ.get("QLLAMA_ISA"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (its import warns; here it is an error)
            from ..kernels._x86 import ISA_PROBLEM
        if ISA_PROBLEM:
            raise click.UsageError(ISA_PROBLEM)


# -- Ctrl-C ------------------------------------------------------------------------------------
#
# A Ctrl-C normally raises KeyboardInterrupt wherever Python is. During a Numba compile it may
# land inside a ctypes callback (LLVM calling back into llvmlite when the object code is ready):
# ctypes cannot propagate it, so it reports it to sys.unraisablehook and the callback returns
# as if nothing happened. Numba then finds no object code for the library it just compiled and
# raises `RuntimeError: no compiled object yet for <Library ...>` while saving it to its cache.
# The hook below records such a swallowed interrupt (silently), and main turns the error that
# follows (or the next check, `reraise_lost_interrupt`) back into a clean exit 130. main's SIGINT
# handler also counts the signals, so that an interrupt swallowed anywhere else (a bare
# `except:` in a library) is noticed too.

_lost = {"interrupt": False, "sigints": 0}
_saved = {"showwarning": warnings.showwarning, "unraisablehook": sys.unraisablehook}


def _unraisable_hook(unraisable) -> None:
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _lost["interrupt"] = True
        return
    if _lost["interrupt"] or _lost["sigints"]:  # after a Ctrl-C, objects torn down mid-way (LLVM's, in
        return  # a compile) may fail in their __del__: noise on the way out, not an error to show
    _saved["unraisablehook"](unraisable)


def _on_sigint(signum, frame) -> None:
    _lost["sigints"] += 1
    raise KeyboardInterrupt


def sigint_count() -> int:
    """How many SIGINTs (Ctrl-C) this command has received so far."""
    return _lost["sigints"]


def reraise_lost_interrupt(since: int | None = None) -> None:
    """Raise KeyboardInterrupt if a Ctrl-C was swallowed: reported to sys.unraisablehook by a C
    callback (e.g. during a compile), or, given `since` (a `sigint_count()` taken before the
    work), a SIGINT arrived meanwhile although the work returned normally."""
    if _lost["interrupt"] or (since is not None and _lost["sigints"] > since):
        raise KeyboardInterrupt


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    from ..errors import QllamaWarning

    if issubclass(category, QllamaWarning):
        click.echo(f"warning: {message}", err=True)
    else:
        _saved["showwarning"](message, category, filename, lineno, file, line)


def _error_message(e: BaseException) -> str:
    from ..errors import ContextOverflowError, ContextSizeError, OutputExistsError

    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, FileNotFoundError) and e.filename:
        msg = f"{e.filename}: no such file"
    elif isinstance(e, OSError) and e.filename and e.strerror:
        msg = f"{e.filename}: {e.strerror.lower()}"
    # library errors name no flags: the CLI adds the one that helps
    hints = {ContextSizeError: "lower -c/--ctx-size", ContextOverflowError: "raise -c/--ctx-size",
             OutputExistsError: "use --force to overwrite it"}
    for cls, hint in hints.items():
        if isinstance(e, cls):
            msg += f" ({hint})"
    return msg


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from ..errors import QllamaError

    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args
    try:
        args, notices = rewrite_argv(args)
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    for note in notices:
        click.echo(note, err=True)
    old_hook, old_show, old_sigint = sys.unraisablehook, warnings.showwarning, signal.getsignal(signal.SIGINT)
    _saved["showwarning"], _saved["unraisablehook"] = old_show, old_hook
    sys.unraisablehook, warnings.showwarning = _unraisable_hook, _show_warning
    if old_sigint is signal.default_int_handler:  # (not when SIGINT is ignored, e.g. a background job)
        signal.signal(signal.SIGINT, _on_sigint)
    _lost["interrupt"], _lost["sigints"] = False, 0
    try:
        if not args:  # like git and ollama: the help, on stdout, and success
            with click.Context(cli, info_name="qllama") as ctx:
                click.echo(cli.get_help(ctx))
            return
        name = next((a for a in args if not a.startswith("-")), None)
        if name in COMMANDS:
            with click.Context(cli, info_name="qllama") as ctx:
                check_single_dash(args[args.index(name) + 1:], cli.get_command(ctx, name))
        rv = cli.main(args=args, prog_name="qllama", standalone_mode=False)
        if isinstance(rv, int) and rv:
            sys.exit(rv)
    except (KeyboardInterrupt, click.exceptions.Abort):
        _interrupted()
    except click.ClickException as e:  # usage errors: exit 2 (click's own convention)
        if _lost["interrupt"]:
            _interrupted()
        if debug:
            raise
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except (QllamaError, OSError, MemoryError) as e:
        if _lost["interrupt"]:
            _interrupted()
        if debug:
            raise
        click.echo(f"error: {_error_message(e)}", err=True)
        sys.exit(1)
    except Exception:
        if _lost["interrupt"] or _lost["sigints"]:  # e.g. Numba's RuntimeError after a swallowed Ctrl-C (see above)
            _interrupted()
        raise
    finally:
        warnings.showwarning = old_show
        if not (_lost["interrupt"] or _lost["sigints"]):  # (interrupted: the hook stays for the shutdown)
            sys.unraisablehook = old_hook
        if old_sigint is signal.default_int_handler:
            signal.signal(signal.SIGINT, old_sigint)


def _interrupted() -> None:
    click.echo("\ninterrupted", err=True)
    sys.exit(130)
