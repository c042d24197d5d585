"""`qllama pull REF`: download a model from the Hugging Face Hub into its cache (or update it)."""

from __future__ import annotations

import click

from ..hub import refs as hub
from .model_ref import fetch_model


@click.command("pull")
@click.argument("ref", metavar="REF")
@click.option("--check", is_flag=True, help="Scan the downloaded tensors for NaN and Inf (as inspect --check); exit 1 if any.")
def command(ref: str, check: bool) -> int:
    """Download REF into the Hugging Face cache and print its path.

    REF is org/repo (the Q4_K_M file, else the best quant it has), org/repo:QUANT,
    org/repo/file.gguf or hf://... . The download resumes where an interrupted one stopped,
    and the file is checked against the hub's sha256 before it is used. A split model comes
    with all its shards. HF_TOKEN, HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE are honoured.
    """
    kind, target = hub.parse(ref)
    if kind == "demo":
        click.echo(target)
        return 0
    if kind == "local":
        raise click.UsageError(f"{ref} is not a hub reference (org/repo[:QUANT], org/repo/file.gguf or hf://...)")
    model = fetch_model(target, refresh=True)
    if not model.downloaded:
        click.echo(f"{model.ref} is up to date ({model.size / 1e6:.1f} MB)", err=True)
    click.echo(model.path)
    if check:
        from ..gguf.reader import GGUFFile
        from .check_report import run_check

        with GGUFFile(model.path) as gf:
            return 0 if run_check(gf) else 1
    return 0
