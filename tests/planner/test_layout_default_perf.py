"""kvd's own engines and the bench get the layout with the fewest descriptors."""

from __future__ import annotations

import msgspec
from typer.testing import CliRunner

from kvd.cli import app
from kvd.planner.layout import KV_LAYOUTS
from kvd.tools.bench.geometry import DEFAULT_KV_LAYOUT, Geometry
from kvd.wire import protocol as P


def test_layout_spec_defaults_to_auto_which_is_head_major_for_hnd() -> None:
    from kvd.daemon.engines.table import resolve_layout

    spec = P.LayoutSpec(num_blocks=8, block_size_tokens=16)
    assert spec.kv_layout == "auto" and spec.head_layout == "HND"
    model = P.ModelSpec(name="m", num_kv_heads=8, num_layers=2, head_dim=64)
    assert resolve_layout(model, spec).kv_layout == "head_major"
    assert Geometry().kv_layout == DEFAULT_KV_LAYOUT == "head_major" and \
        DEFAULT_KV_LAYOUT in KV_LAYOUTS


def test_explicit_layout_still_travels_on_the_wire() -> None:
    """LayoutSpec encodes every field, so a daemon with another default never reinterprets
    an engine's explicit kv_split."""
    wire = msgspec.msgpack.encode(P.LayoutSpec(num_blocks=8, block_size_tokens=16,
                                                 kv_layout="kv_split"))
    assert msgspec.msgpack.decode(wire, type=P.LayoutSpec).kv_layout == "kv_split"
    assert b"kv_layout" in msgspec.msgpack.encode(P.LayoutSpec(num_blocks=8,
                                                                 block_size_tokens=16))


def test_bench_plot_needs_curves() -> None:
    result = CliRunner().invoke(app, ["bench", "--plot", "x.png"])
    assert result.exit_code != 0 and "--plot needs --curves" in result.output


def test_bench_help_lists_curve_options() -> None:
    out = CliRunner().invoke(app, ["bench", "--help"]).output
    assert "--curves" in out and "--max-mib" in out and "head_major" in out
