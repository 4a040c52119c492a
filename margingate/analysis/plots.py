"""PNG plots for `flips`, `calibrate` and `bench` (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Lay out, write at 110 dpi and close one figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


# --- flips ---------------------------------------------------------------------------

def flips_plots(rep: dict, out: Path) -> list[Path]:
    written = []
    if rep["table2_table11_kv_deviation"].get("trials"):
        written.append(_kv_flip_aligned(rep, out))
    if len(rep["margins"]["stable"]):
        written.append(_margins(rep, out))
    written.append(_flip_rate(rep, out))
    return written


def _kv_flip_aligned(rep: dict, out: Path) -> Path:
    kv = rep["table2_table11_kv_deviation"]
    pos = np.array(kv["positions"])
    layers = kv["layers"]
    fig, axes = _plt().subplots(1, 2, figsize=(11, 4), sharex=True)
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
    return _save(fig, out / "kv_flip_aligned.png")


def _margins(rep: dict, out: Path) -> Path:
    m = rep["margins"]
    stable, flip = np.array(m["stable"]), np.array(m["flip"])
    fig, ax = _plt().subplots(figsize=(7, 4))
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
    return _save(fig, out / "margins.png")


def _flip_rate(rep: dict, out: Path) -> Path:
    fig, ax = _plt().subplots(figsize=(6, 3.5))
    for mode, per in rep["table1_flip_rate"].items():
        if per:
            sizes = list(per)
            ax.plot([int(s) for s in sizes], [100 * (per[s]["flip_rate"] or 0) for s in sizes], marker="o", label=mode)
    ax.set_xlabel("batch size")
    ax.set_ylabel("synchronous flip rate (%)")
    ax.set_title(f"Table 1: flip rate ({rep['dataset']})")
    ax.legend()
    return _save(fig, out / "flip_rate.png")


# --- calibrate -------------------------------------------------------------------------

def frontier_plot(rep: dict, out: Path) -> Path:
    rows = rep["table7_frontier"]
    taus = [r["tau"] for r in rows]
    fig, ax = _plt().subplots(figsize=(7, 4))
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
    return _save(fig, out / "frontier.png")


# --- bench -----------------------------------------------------------------------------

def bench_plots(report: dict, out: Path, baseline: str) -> list[Path]:
    """Overheads over the `baseline` variant (grey) per batch size, the batch-size curve and the
    protected-share sweep."""
    paths = [_overhead(key, summary, baseline, out) for key, summary in report["main"].items()]
    if len(report["main"]) > 1:
        paths.append(_batch_size_curve(report["main"], out, report.get("roofline")))
    if report.get("protected_sweep"):
        paths.append(_protected_sweep(report["protected_sweep"], baseline, out))
    return paths


def _overhead(key: str, summary: dict, baseline: str, out: Path) -> Path:
    fig, ax = _plt().subplots(figsize=(8, 4))
    names = list(summary)
    ax.bar(names, [100 * summary[n].get("overhead", 0) for n in names],
           color=["#999" if n == baseline else "#c44" if (summary[n]["sequence_determinism"] or 0) < 1 else "#4a4"
                  for n in names])
    ax.set_ylabel("time overhead over fast (%)")
    ax.set_title(f"{key}: green = 100% sequence determinism, red = not")
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, out / f"overhead_{key}.png")


def _batch_size_curve(main: dict, out: Path, roofline: dict | None = None) -> Path:
    """Tokens/s and overhead against B for every policy and peer; the machine's floor drawn in."""
    sizes = sorted(int(k[1:]) for k in main)
    fig, axes = _plt().subplots(1, 2, figsize=(11, 4))
    for v in main[f"B{sizes[0]}"]:
        axes[0].plot(sizes, [main[f"B{b}"][v]["tokens_per_s"] for b in sizes], "o-", label=v)
        axes[1].plot(sizes, [100 * main[f"B{b}"][v].get("overhead", 0) for b in sizes], "o-", label=v)
    if roofline:
        axes[0].plot(sizes, [roofline["floor"][f"B{b}"]["tokens_per_s"] for b in sizes], "k--",
                     label="floor (roofline)")
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=7)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("time overhead over fast (%)")
    for ax in axes:
        ax.set_xlabel("batch size")
        ax.set_xscale("log", base=2)
    axes[1].legend(fontsize=8)
    return _save(fig, out / "batch_size_curve.png")


def _protected_sweep(sweep: dict, baseline: str, out: Path) -> Path:
    fig, ax = _plt().subplots(figsize=(7, 4))
    shares = sorted(sweep, key=float)
    for v in next(iter(sweep.values())):
        if v == baseline:
            continue
        ax.plot([100 * float(s) for s in shares], [100 * sweep[s][v]["overhead"] for s in shares], "o-", label=v)
    ax.set_xlabel("protected requests (%)")
    ax.set_ylabel("overhead over fast (%)")
    ax.legend()
    return _save(fig, out / "protected_sweep.png")
