"""The ``kvd`` command line.

Every command imports its implementation lazily: ``kvd --help`` and ``kvd plan``
must not pay for torch or NIXL (0.5 s budget), only ``serve``, ``demo`` and
``bench`` need them.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kvd: KV-cache transfer daemon for disaggregated LLM serving.",
)


@app.callback()
def main() -> None:
    """kvd: KV-cache transfer daemon for disaggregated LLM serving."""


def _fail(message: str) -> None:
    typer.echo(f"kvd: error: {message}", err=True)
    raise typer.Exit(2)


@app.command()
def plan(
    kv_heads: int = typer.Option(..., "--kv-heads", help="Total KV heads of the model."),
    layers: int = typer.Option(..., "--layers", help="Total layers of the model."),
    prefill_tp: int = typer.Option(..., "--prefill-tp", help="Prefill TP size."),
    decode_tp: int = typer.Option(..., "--decode-tp", help="Decode TP size."),
    prefill_pp: int = typer.Option(1, "--prefill-pp", help="Prefill PP size."),
    decode_pp: int = typer.Option(1, "--decode-pp", help="Decode PP size."),
    prefill_layers: str | None = typer.Option(
        None, "--prefill-layers", help="Explicit prefill layer partition, e.g. 10,11,11."
    ),
    decode_layers: str | None = typer.Option(
        None, "--decode-layers", help="Explicit decode layer partition."
    ),
    mla: bool = typer.Option(False, "--mla", help="MLA: one latent cache on every rank."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Show which bytes every decode rank reads from which prefill rank."""
    from kvd.errors import KvdError
    from kvd.planner.render import render_plan_cli

    try:
        typer.echo(
            render_plan_cli(
                kv_heads=kv_heads,
                layers=layers,
                prefill_tp=prefill_tp,
                decode_tp=decode_tp,
                prefill_pp=prefill_pp,
                decode_pp=decode_pp,
                prefill_layers=prefill_layers,
                decode_layers=decode_layers,
                mla=mla,
                as_json=as_json,
            )
        )
    except KvdError as exc:
        _fail(str(exc))


if __name__ == "__main__":  # pragma: no cover
    app()
