"""PNG figures of a run: each panel plots one metric against the number of Services (or what the figure's
`xlabel` names), one line per series, and every figure names the machine and the run in its footnote."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the headless backend
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from bench.core import Figure, Measurement, Panel  # noqa: E402

FIXED = ("bpf", "nftables", "iptables-legacy", "iptables-nft", "kube-proxy iptables-legacy", "kube-proxy iptables-nft",
         "userspace")


def _label(series: str, panel: Panel) -> str:
    return series.replace(panel.series, "").strip() if panel.series else series


def render(fig: Figure, measurements: Sequence[Measurement], machine_line: str, path: Path) -> bool:
    """Draw `fig` from `measurements` into `path`; False (nothing written) when it has no numbers."""
    if not any(p.shows(m) and m.value is not None for p in fig.panels for m in measurements):
        return False
    out, axes = plt.subplots(1, len(fig.panels), figsize=(6.4 * len(fig.panels), 4.8), squeeze=False)
    # One colour per series across the figure's panels; a panel that selects series by a part of their name
    # (Panel.series) labels them without it, so "bpf (API server)" and "bpf (manifests)" share bpf's colour.
    palette = [c for c in plt.rcParams["axes.prop_cycle"].by_key()["color"] if c != "#7f7f7f"]  # grey: the floor
    # The dataplanes keep their colour from figure to figure (FIXED first), other series take the next ones.
    names = list(dict.fromkeys([*FIXED, *(_label(m.series, p) for p in fig.panels for m in measurements
                                          if p.shows(m) and m.mode != "floor")]))
    colour = {s: palette[i % len(palette)] for i, s in enumerate(names)}
    for ax, panel in zip(axes[0], fig.panels, strict=True):
        rows = [m for m in measurements if panel.shows(m)]
        unfinished = []
        for series in dict.fromkeys(m.series for m in rows):
            label = _label(series, panel)
            points = sorted((m.services, m.value) for m in rows if m.series == series and m.value is not None)
            missing = [f"{m.services:,}" for m in rows if m.series == series and m.value is None]
            if missing:
                unfinished.append(f"{label} @ {', '.join(missing)}")
            if not points:
                continue
            mode = next(m.mode for m in rows if m.series == series)
            style = {"linestyle": "--", "color": "0.4"} if mode == "floor" else {"color": colour[label]}
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label, **style)
        ax.set_xscale("log")
        sizes = sorted({m.services for m in rows})
        ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
        ax.minorticks_off()
        if panel.logy:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(bottom=0 if not panel.logy else None)
        ax.set_xlabel(fig.xlabel)
        ax.set_ylabel(panel.ylabel)
        # Many series without a number (a path not served yet) are counted, not named: the table says why.
        missing_text = "; ".join(unfinished) if len(unfinished) <= 4 else f"{len(unfinished)} series (see the table)"
        title = panel.title + ("\n" + textwrap.fill(f"no number: {missing_text}", 90) if unfinished else "")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    out.suptitle(fig.title)
    out.text(0.5, 0.01, machine_line, ha="center", va="bottom", fontsize=7, color="0.3")
    out.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    out.savefig(path, dpi=110)
    plt.close(out)
    return True
