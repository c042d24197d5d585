"""Printing a tensor check (`inspect --check`, `run --check-tensors`, `pull --check`)."""

from __future__ import annotations

import time

import click

from ..gguf.reader import GGUFFile


def run_check(gf: GGUFFile, *, quiet_ok: bool = False) -> bool:
    """Scan every tensor of `gf` for NaN/Inf; print one line per bad tensor on stderr and a
    summary line. Returns True when every tensor is finite."""
    from ..report.check import check_tensors

    t0 = time.perf_counter()
    report = check_tensors(gf)
    dt = time.perf_counter() - t0
    for f in report.findings:
        click.echo(f"error: {f.describe()}", err=True)
    for name in report.unchecked:
        click.echo(f"warning: tensor {name} has a type the check cannot read: not checked", err=True)
    summary = (f"checked {report.n_tensors - len(report.unchecked)} tensors ({report.n_bytes / 1e6:.1f} MB) "
               f"in {dt:.2f} s: ")
    if report.ok:
        if not quiet_ok:
            click.echo(summary + "all finite", err=True)
    else:
        click.echo(summary + f"{len(report.findings)} tensor(s) hold NaN or Inf", err=True)
    return report.ok


def check_json(gf: GGUFFile) -> dict:
    """The check as a JSON-able dict (for `inspect --check --json`)."""
    from ..report.check import check_tensors

    report = check_tensors(gf)
    return {
        "ok": report.ok,
        "tensors_checked": report.n_tensors - len(report.unchecked),
        "bytes_checked": report.n_bytes,
        "unchecked": report.unchecked,
        "findings": [{"tensor": f.name, "type": f.type_name, "unit": f.unit, "count": f.count,
                      "total": f.total, "first": f.first} for f in report.findings],
    }
