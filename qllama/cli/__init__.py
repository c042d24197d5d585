"""The `qllama` command line: a click group whose commands live one per module.

Commands are imported lazily, so that `qllama inspect` or `qllama tokenize` never pay for
importing numba. Every command module exposes a click command named `command`.
Errors that are the user's (QllamaError, a missing file...) become one `error:` line on
stderr and exit status 1; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import sys

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
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="qllama")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """qllama: run quantized GGUF language models on the CPU."""
    ctx.obj = {"debug": debug}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from ..errors import QllamaError

    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        rv = cli.main(args=args, prog_name="qllama", standalone_mode=False)
        if isinstance(rv, int) and rv:
            sys.exit(rv)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:  # usage errors: exit 2 (click's own convention)
        if debug:
            raise
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except (QllamaError, OSError, MemoryError) as e:
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        click.echo(f"error: {msg}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(130)
