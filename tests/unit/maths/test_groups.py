"""THE layer and band grouping (posgen_tl.maths.groups): thirds, contiguous, covering, one definition."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posgen_tl.maths.groups import band_group, band_groups, group_label, layer_group, layer_groups


@given(st.integers(1, 200))
def test_layer_groups_partition_into_contiguous_thirds(n):
    groups = layer_groups(n)
    assert list(groups) == ["early", "middle", "late"]
    flat = [x for g in groups.values() for x in g]
    assert flat == list(range(n))  # disjoint, ordered, covering
    sizes = [len(g) for g in groups.values()]
    if n >= 3:
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    for name, ls in groups.items():
        assert all(layer_group(x, n) == name for x in ls)
        assert ls == list(range(ls[0], ls[-1] + 1)) if ls else True


@pytest.mark.parametrize("n,middle", [(18, range(6, 12)), (24, range(8, 16)), (26, range(9, 18)), (28, range(10, 19)),
                                      (30, range(10, 20)), (32, range(11, 22)), (40, range(14, 27)), (80, range(27, 54))])
def test_middle_third_of_common_depths(n, middle):
    assert layer_groups(n)["middle"] == list(middle)


def test_band_groups_and_labels():
    assert [band_group(b, 6) for b in range(6)] == ["fast", "fast", "middle", "middle", "slow", "slow"]
    assert band_groups(32)["fast"] == list(range(11))
    assert group_label(range(10, 20)) == "10–19" and group_label([3]) == "3" and group_label([0, 2, 5]) == "0,2,5"


@pytest.mark.parametrize("call,match", [(lambda: layer_group(5, 5), "outside"), (lambda: layer_group(0, 0), "at least one"),
                                        (lambda: group_label([]), "empty")])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
