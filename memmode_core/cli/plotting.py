"""``memmode run --plot``: resident device bytes over time, one line per mode."""

from __future__ import annotations

from collections.abc import Sequence

import memmode_core as memmode


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise memmode.MemmodeError(
            "--plot needs matplotlib: pip install 'memmode-core[plot]' (or pip install matplotlib)"
        ) from None
    return matplotlib


def plot_traces(results: Sequence, path: str) -> None:
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=120)
    for result in results:
        if not result.trace:  # a refused mode has none
            continue
        times = [t for t, _ in result.trace]
        mib = [b / 2**20 for _, b in result.trace]
        label = result.mode if result.requested == result.mode else f"{result.requested} -> {result.mode}"
        label += f" ({result.storage})" if result.storage else ""
        axes.step(times, mib, where="post", label=label, linewidth=1.2)
    axes.set_xlabel("seconds into the measured call")
    axes.set_ylabel("weights resident on the device (MiB)")
    axes.set_title("memmode: device memory over one call")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
