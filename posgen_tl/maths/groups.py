"""THE grouping of layers and RoPE bands into thirds — one definition, used by every experiment.

Layer ``l`` of an ``n``-layer model is in third ``⌊3l / n⌋``: ``early``, ``middle``, ``late``.
For a 30-layer model (SmolLM2) that is 0–9 / 10–19 / 20–29, for 18 layers (Gemma3) 0–5 / 6–11 /
12–17, for 32 layers (Llama-3-8B, Mistral-7B) 0–10 / 11–21 / 22–31. The causal test edits the
``middle`` group by default, the sufficiency test substitutes each group, the decomposition and
taxonomy tables are summarised per group — always these groups.

Band ``m`` of ``r/2`` rotary planes (band 0 = the fastest) is in third ``⌊3m / (r/2)⌋``:
``fast``, ``middle``, ``slow``.
"""

from __future__ import annotations

__all__ = ["LAYER_GROUPS", "BAND_GROUPS", "layer_group", "layer_groups", "group_label", "band_group", "band_groups"]

LAYER_GROUPS = ("early", "middle", "late")
BAND_GROUPS = ("fast", "middle", "slow")


def _third(i: int, n: int) -> int:
    if n < 1:
        raise ValueError(f"need at least one layer/band to group, got n = {n}")
    if not 0 <= i < n:
        raise ValueError(f"index {i} outside 0..{n - 1}")
    return min(3 * i // n, 2)


def layer_group(layer: int, n_layers: int) -> str:
    """``"early"`` / ``"middle"`` / ``"late"``: the third of the model's layers ``layer`` is in."""
    return LAYER_GROUPS[_third(int(layer), int(n_layers))]


def layer_groups(n_layers: int) -> dict[str, list[int]]:
    """``{"early": [...], "middle": [...], "late": [...]}`` — contiguous, disjoint, covering
    ``0..n_layers−1``; a group is empty only when ``n_layers < 3``."""
    out: dict[str, list[int]] = {g: [] for g in LAYER_GROUPS}
    for layer in range(int(n_layers)):
        out[layer_group(layer, n_layers)].append(layer)
    return out


def group_label(layers: list[int] | range) -> str:
    """``"10–19"`` for a contiguous run of layers, else ``"0,3,5"`` (the label tables print)."""
    ls = sorted(int(x) for x in layers)
    if not ls:
        raise ValueError("an empty layer group has no label")
    if ls == list(range(ls[0], ls[-1] + 1)):
        return f"{ls[0]}–{ls[-1]}" if len(ls) > 1 else str(ls[0])
    return ",".join(map(str, ls))


def band_group(band: int, n_bands: int) -> str:
    """``"fast"`` / ``"middle"`` / ``"slow"``: the third of the bands ``band`` is in (band 0 is the fastest)."""
    return BAND_GROUPS[_third(int(band), int(n_bands))]


def band_groups(n_bands: int) -> dict[str, list[int]]:
    """``{"fast": [...], "middle": [...], "slow": [...]}`` over bands ``0..n_bands−1``."""
    out: dict[str, list[int]] = {g: [] for g in BAND_GROUPS}
    for band in range(int(n_bands)):
        out[band_group(band, n_bands)].append(band)
    return out
