"""PNG bar chart of a layer profile: P per layer, coloured by layer type, with the tau threshold line."""
from __future__ import annotations

QUANT_COLOR = "#d9822b"   # quantization-friendly (P > tau)
SPARSE_COLOR = "#3b75af"  # sparsity-friendly


def plot_profile(profile: dict, path: str) -> None:
    """Write the chart of profile ("P", "tau", "model", ...) to path as PNG (path may lack a .png suffix)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    p = list(profile["P"])
    tau = float(profile["tau"])
    n = len(p)
    colors = [QUANT_COLOR if x > tau else SPARSE_COLOR for x in p]
    fig = Figure(figsize=(max(6.0, 0.32 * n + 2.0), 4.2), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    ax.bar(range(n), p, color=colors, width=0.75, zorder=2)
    ax.axhline(tau, color="#c0392b", linestyle="--", linewidth=1.2, zorder=3)
    top = max(max(p, default=0.0), tau) * 1.18 + 0.02
    ax.set_ylim(0.0, min(1.05, top))
    ax.text(n - 0.5, tau, f" tau = {tau:g}", color="#c0392b", va="bottom", ha="right", fontsize=9)
    for i, x in enumerate(p):
        if x > tau:
            ax.text(i, x, f"{x:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(n))
    ax.set_xticklabels([str(i) for i in range(n)], fontsize=7 if n > 24 else 9)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_xlabel("layer")
    ax.set_ylabel("P = 1 - kept attention mass")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    quant = [i for i, x in enumerate(p) if x > tau]
    ax.legend(handles=[Patch(color=QUANT_COLOR, label=f"quantization-friendly (P > tau): {len(quant)}"),
                       Patch(color=SPARSE_COLOR, label=f"sparsity-friendly: {n - len(quant)}")],
              loc="upper right", fontsize=8, framealpha=0.9)
    sub = []
    if "n_q" in profile:  # the rows used: n_q, or fewer on a short prompt
        sub.append(f"last {profile.get('rows', profile['n_q'])} queries")
    if "top_k" in profile:
        sub.append(f"top {profile['top_k']} keys per row")
    elif "top" in profile:
        sub.append(f"top {100 * float(profile['top']):g}% keys")
    tokens = (profile.get("calibration") or {}).get("tokens", profile.get("tokens"))
    if tokens:
        sub.append(f"{tokens} calibration tokens")
    title = f"{profile.get('model', 'model')}: attention spread per layer"
    ax.set_title(title + ("\n" + ", ".join(sub) if sub else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
