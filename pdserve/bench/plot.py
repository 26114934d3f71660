"""PNG plots. matplotlib is imported only here and only when a plot is asked for, so the load
generator itself runs without it."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # a clear message beats a traceback deep in the CLI
        raise RuntimeError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only; never try to open a display
    import matplotlib.pyplot as plt

    return plt


def plot_tradeoff(
    series: dict[str, list[dict]], path: str | Path, title: str = "throughput vs per-user speed"
) -> None:
    """Aggregate output tok/s (y) against per-user tok/s (x), one line per system, each point
    labelled with its concurrency: the throughput-versus-experience curve. Up and to the
    right is better; moving along a line is the knob documented in docs/bench.md."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, pts in series.items():
        pts = [p for p in pts if p["completed"]]
        xs = [p["per_user_tok_s"]["p50"] for p in pts]
        ys = [p["output_throughput_tok_s"] for p in pts]
        ax.plot(xs, ys, marker="o", label=name)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(
                f"c={p.get('concurrency', '?')}",
                (x, y),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
    ax.set_xlabel("per-user tok/s (p50 of 1000/TPOT)")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_run(records, path: str | Path, title: str = "latency") -> None:
    """One run: empirical CDFs of TTFT and of ITL, the two numbers a user feels."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ok = [r for r in records if r.ok]
    for ax, label, vals in (
        (axes[0], "TTFT (ms)", [r.ttft * 1000 for r in ok if r.ttft is not None]),
        (axes[1], "inter-token latency (ms)", [g * 1000 for r in ok for g in r.itls]),
    ):
        vals = sorted(vals)
        if vals:
            ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(names: list[str], values: list[float], path: str | Path, ylabel: str, title: str) -> None:
    """Side-by-side bars, one per system (benchmarks/compare.py)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(names)), 4.5))
    bars = ax.bar(names, values)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
