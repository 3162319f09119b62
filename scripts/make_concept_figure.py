"""Draw docs/img/bound_factor.png (pure maths, no model): python scripts/make_concept_figure.py"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

d = np.arange(0, 2049)
theta = 1.0 / 1e5 ** (np.arange(0, 64, 2) / 64)  # SmolLM2: base 1e5, 32 bands
fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=110)
for m, c in [(0, "tab:red"), (16, "tab:orange"), (31, "tab:blue")]:
    ax.plot(d, 2 * np.abs(np.sin(d * theta[m] / 2)), color=c, lw=1, label=f"band {m} (period {2*np.pi/theta[m]:.0f} tokens)")
ax.set_xscale("symlog", linthresh=10)
ax.set_xlabel("distance i − j (tokens)")
ax.set_ylabel("2|sin(Δθ/2)|")
ax.set_title("How much a band's rotation can move a key residual")
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
fig.savefig("docs/img/bound_factor.png")
