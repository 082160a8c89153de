"""PNG pictures of `DepthProfile`s: depth-attention maps (as the paper's Figure 8) and per-sublayer magnitude and
gradient profiles, with several models side by side (or overlaid) so a baseline and its AttnRes twin compare."""

from pathlib import Path

from .depth_attention import draw_depth_attention
from .profiles import DepthProfile


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_depth_attention(profiles: list[DepthProfile], path: Path) -> Path:
    """One row per model with depth attention (`attnres.analysis.depth_attention`: the grid and picture of
    `attnres demo`): rows are the mixing steps in sublayer order, columns the sources b0 (embedding) .. bN, partial."""
    tables = [(f"{p.label} ({p.residual_mode})", p.depth_attention()) for p in profiles if p.attention_weights]
    return draw_depth_attention(tables, path)


def _plot_lines(profiles: list[DepthProfile], series: list[tuple[str, str]], title: str, path: Path) -> Path:
    """One panel per `(attribute, y label)` in `series`, each model a line over sublayers 1..L on a log scale."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4), squeeze=False)
    for axis, (attribute, ylabel) in zip(axes[0], series):
        for profile in profiles:
            values = getattr(profile, attribute)
            axis.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=profile.label)
        axis.set_yscale("log")
        axis.set_xlabel("sublayer l (odd: attention, even: MLP)")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_magnitudes(profiles: list[DepthProfile], path: Path) -> Path:
    return _plot_lines(
        profiles,
        [("output_rms", "RMS of the sublayer output v_l"), ("input_rms", "RMS of the sublayer input h_l")],
        "Per-sublayer magnitudes",
        path,
    )


def plot_gradient_norms(profiles: list[DepthProfile], path: Path) -> Path:
    return _plot_lines(
        profiles,
        [("gradient_norms", "||dLoss / d(sublayer weights)||")],
        "Per-sublayer gradient norms (language-modelling loss on the text)",
        path,
    )


def write_pictures(profiles: list[DepthProfile], output_dir: Path) -> list[Path]:
    """All pictures for `profiles` in `output_dir`; the depth-attention map only if some model has depth attention."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_magnitudes(profiles, output_dir / "magnitudes.png"),
        plot_gradient_norms(profiles, output_dir / "gradient_norms.png"),
    ]
    if any(p.attention_weights for p in profiles):
        paths.insert(0, plot_depth_attention(profiles, output_dir / "depth_attention.png"))
    return paths
