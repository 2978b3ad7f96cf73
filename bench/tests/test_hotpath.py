"""bench.hotpath's bookkeeping that needs no run: which repeats were measured whole."""

from __future__ import annotations

from bench.hotpath import whole_repeats


def test_a_repeat_the_budget_cut_is_not_counted_whole():
    def points(repeat: int, scenarios: int) -> list[dict[str, int]]:
        return [{"repeat": repeat} for _ in range(scenarios)]

    runs = {"direct": points(0, 2) + points(1, 2) + points(2, 1),
            "proxy-2w": points(0, 2) + points(1, 2)}
    assert whole_repeats(runs, 2) == 2
    assert whole_repeats({"direct": points(0, 1)}, 2) == 0
