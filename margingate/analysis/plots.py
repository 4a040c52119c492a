"""PNG plots for `flips` and `calibrate` (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def flips_plots(rep: dict, out: Path) -> list[Path]:
    plt = _plt()
    written = []
    kv = rep["table2_table11_kv_deviation"]
    if kv.get("trials"):
        pos = np.array(kv["positions"])
        layers = kv["layers"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
        for ax, key, name in ((axes[0], "mean_K", "K"), (axes[1], "mean_V", "V")):
            m = np.array(kv[key], dtype=float)  # [positions, layers]
            for li, label in ((0, "first"), (layers // 2, "mid"), (layers - 1, "last")):
                ax.plot(pos, m[:, li], marker=".", label=f"layer {li} ({label})")
            rep5 = rep.get("table5_oracle_repair") or {}
            for size, r in rep5.items():
                dev = r.get("repaired_dev_last_layer") or {}
                if dev.get("positions"):
                    ax.plot(dev["positions"], dev[key], ls="--", color="k", lw=1,
                            label=f"last layer, oracle-repaired (b={size})")
                    break
            ax.axvline(0, color="grey", lw=0.8)
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("position relative to the first flip (j - d)")
            ax.set_ylabel(f"mean max |{name} - {name}_ref|")
            ax.set_title(f"{name} deviation, {kv['trials']} trials")
            ax.legend(fontsize=7)
        fig.suptitle(f"Fig. 1: flip-aligned K/V deviation ({rep['dataset']})")
        fig.tight_layout()
        written.append(out / "kv_flip_aligned.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    m = rep["margins"]
    stable, flip = np.array(m["stable"]), np.array(m["flip"])
    if len(stable):
        fig, ax = plt.subplots(figsize=(7, 4))
        hi = max(2.0, float(np.quantile(stable, 0.9)) if len(stable) else 2.0)
        bins = np.arange(0, hi + 0.0625, 0.0625)
        ax.hist(np.clip(stable, 0, hi), bins=bins, density=True, alpha=0.55, label=f"stable steps ({len(stable)})")
        if len(flip):
            ax.hist(np.clip(flip, 0, hi), bins=bins, density=True, alpha=0.7, label=f"flip steps ({len(flip)})")
        ax.set_yscale("log")
        ax.set_xlabel("top-1 minus top-2 batched logit (clipped)")
        ax.set_ylabel("density")
        ax.set_title(f"Margin at stable vs flip steps ({rep['dataset']})")
        ax.legend()
        fig.tight_layout()
        written.append(out / "margins.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    t1 = rep["table1_flip_rate"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, per in t1.items():
        if per:
            sizes = list(per)
            ax.plot([int(s) for s in sizes], [100 * (per[s]["flip_rate"] or 0) for s in sizes], marker="o", label=mode)
    ax.set_xlabel("batch size")
    ax.set_ylabel("synchronous flip rate (%)")
    ax.set_title(f"Table 1: flip rate ({rep['dataset']})")
    ax.legend()
    fig.tight_layout()
    written.append(out / "flip_rate.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def frontier_plot(rep: dict, out: Path) -> Path:
    plt = _plt()
    rows = rep["table7_frontier"]
    taus = [r["tau"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(taus, [100 * r["trigger_rate"] for r in rows], marker="o", label="trigger rate (%)")
    ax.plot(taus, [100 * r["sequence_determinism"] for r in rows], marker="s", label="seq. determinism (%)")
    ax.plot(taus, [np.nan if r.get("overhead") is None else 100 * r["overhead"] for r in rows],
            marker="^", label="overhead vs fast (%, noisy on a shared CPU)")
    if rep.get("tau") is not None:
        ax.axvline(rep["tau"], color="grey", ls="--", lw=1, label=f"chosen tau = {rep['tau']}")
    ax.set_xlabel("tau (logits)")
    ax.set_ylabel("%")
    ax.set_title(f"Table 7: threshold frontier ({rep['dataset']}, strict=False)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "frontier.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
