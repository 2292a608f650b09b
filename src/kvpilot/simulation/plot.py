"""Timeline plot of simulator runs (matplotlib, imported lazily; a ``dev`` extra).

One column per trace, three rows: mean KV usage of the ready replicas, requests waiting,
and replicas paid for (starting + ready + draining), one line per policy (and routing,
when the runs compare several). The grey band
is the warm-up, which is not counted. Kept out of ``kvpilot.autoscaler`` so that package
stays standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.autoscaler.sim.report import SimResult

_ROWS = (
    ("usage", "mean KV usage (ready)"),
    ("waiting", "requests waiting"),
    ("replicas", "replicas (paid)"),
)


def plot_timelines(results: Sequence[SimResult], path: str) -> None:
    """Write a PNG to ``path``. Raises RuntimeError with an install hint if matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install 'kvpilot[dev]'") from exc
    traces = list(dict.fromkeys(r.trace for r in results))
    several = len({r.routing for r in results}) > 1

    def name(r: SimResult) -> str:
        return f"{r.policy}/{r.routing}" if several else r.policy

    fig, axes = plt.subplots(
        len(_ROWS), len(traces), figsize=(6 * len(traces), 8), sharex="col", squeeze=False
    )
    for col, trace in enumerate(traces):
        runs = [r for r in results if r.trace == trace]
        for row, (field, label) in enumerate(_ROWS):
            ax = axes[row][col]
            for r in runs:
                minutes = [t / 60.0 for t in r.timeline.time]
                ax.plot(minutes, getattr(r.timeline, field), label=name(r), linewidth=1.0)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if runs and runs[0].warmup_seconds:
                ax.axvspan(0, runs[0].warmup_seconds / 60.0, color="0.9", zorder=0)
            if row == 0:
                ax.set_title(
                    f"{trace}: starvation s "
                    + ", ".join(f"{name(r)} {r.starvation_seconds:,.0f}" for r in runs),
                    fontsize=9,
                )
                ax.set_ylim(0, 1.05)
            if field == "waiting":
                ax.set_yscale("symlog", linthresh=10)
        axes[-1][col].set_xlabel("minutes")
        axes[0][col].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
