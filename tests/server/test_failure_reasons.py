"""A device's failure reason as operators see it: printable, one line, bounded; and a round's summary."""

from __future__ import annotations

from fedlink.server.domain import MAX_FAILURE_REASON, failure_reason, summarize_failures


def test_a_reason_is_one_printable_line() -> None:
    assert (
        failure_reason("ValueError: bad\n\tshape\x1b[31m  (3, 4)\x00") == "ValueError: bad shape [31m (3, 4)"
    )
    assert failure_reason("") == ""
    assert failure_reason("  \n ") == ""


def test_a_long_reason_is_cut_with_an_ellipsis() -> None:
    cut = failure_reason("x" * 5000)
    assert len(cut) == MAX_FAILURE_REASON and cut.endswith("…")
    exact = "y" * MAX_FAILURE_REASON
    assert failure_reason(exact) == exact


def test_a_summary_counts_the_most_common_reasons_first() -> None:
    reasons = ["B", "A", "A", "C", "", "D", "A", "B"]
    assert summarize_failures(reasons, most=3) == (
        '8 failed: "A" (3), "B" (2), "C" (1) and 2 other reasons'  # "" and "D" are the others
    )
    assert summarize_failures(["", ""]) == '2 failed: "no reason given" (2)'
    assert summarize_failures([]) == ""
