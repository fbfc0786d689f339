"""Plot how the client learning rate γ (and K) moves LocalUpdate's fixed point x*(γ, Θ).

    python -m simulations.tools.surrogate_plot [OUT.png]        # default: outputs/surrogate_fixed_point.png

Charles & Konečný, *On the Outsized Importance of Learning Rates in Local Update Methods*, 2020, §4
(seed ``003_2dc7ddae5cbdc81f.txt``).  Left: the two-client example (A=1, c=1 and A=2, c=½; true minimiser 2/3),
surrogate minimiser for Θ_{1:K} (FedAvg/Reptile), Θ_K (FOMAML) as γ varies; Θ_{1:2} is (4−3γ)/(6−5γ).
Right: the continuum example of Fig. 1 (f_i(x) = ½ i x² − x, i ∈ [0.5, 2], density 8i/15) for Θ_{1:K};
γ = 0 or K = 1 gives the true minimiser 1/E[i] ≈ 0.714, K → ∞ the mean client minimiser E[1/i] = 0.8.
Pure NumPy (``flower_strategies.analysis.quadratic``) + matplotlib; runs in about a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from flower_strategies.analysis import quadratic as QT

DEFAULT_OUT = Path("outputs") / "surrogate_fixed_point.png"


def curves() -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The plotted data: ``{panel: {label: (γ grid, x*(γ))}}``."""
    mats, cs = QT.two_client_example()
    g_left = np.linspace(0.0, 0.45, 91)
    left: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for k in (1, 2, 5, 10):
        left[f"Θ_1:{k} (FedAvg/Reptile, K={k})"] = (
            g_left, np.array([QT.surrogate_minimizer(mats, cs, g, QT.theta_preset("fedavg", k))[0] for g in g_left])
        )
    left["Θ_5 (FOMAML, K=5)"] = (
        g_left, np.array([QT.surrogate_minimizer(mats, cs, g, QT.theta_preset("fomaml", 5))[0] for g in g_left])
    )
    g_right = np.linspace(0.0, 1.0, 51)
    right = {
        f"Θ_1:{k}": (g_right, np.array([QT.continuum_minimizer(g, k, num=801) for g in g_right])) for k in (1, 2, 5, 20)
    }
    return {"two-client example (§4)": left, "continuum example (Fig. 1)": right}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT), help=f"PNG path (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves()
    refs = {
        "two-client example (§4)": [(2 / 3, "true minimiser 2/3"), (0.75, "mean client minimiser 3/4")],
        "continuum example (Fig. 1)": [(1 / 1.4, "true minimiser 1/E[i]"), (0.8, "mean client minimiser E[1/i]")],
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (title, lines) in zip(axes, data.items(), strict=True):
        for label, (g, x) in lines.items():
            ax.plot(g, x, label=label)
        for y, label in refs[title]:
            ax.axhline(y, color="grey", ls="--" if "true" in label else ":", lw=1, label=label)
        ax.set_title(title)
        ax.set_xlabel("client learning rate γ")
        ax.set_ylabel("fixed point x*(γ, Θ)")
        ax.legend(fontsize=7)
    fig.suptitle("LocalUpdate converges to the surrogate minimiser x*(γ, Θ), not to argmin f")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
