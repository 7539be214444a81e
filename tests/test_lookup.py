"""Lookup drafts (elm_memory/backends/lookup.py): where guesses come from, and where they may not."""

from __future__ import annotations

import pytest

from elm_memory.backends.lookup import LookupDrafter


def test_a_draft_continues_the_latest_match_of_the_rows_last_tokens():
    d = LookupDrafter([[5, 6, 7, 8, 9]], [0], max_draft=3)
    d.extend(0, [1, 6, 7])
    assert d.draft(0) == [8, 9, 1]  # "6 7" was followed by 8 9 in the prompt (then the text goes on)
    d.extend(0, [2, 6, 7])
    assert d.draft(0) == [2, 6, 7]  # the latest "6 7" is now the row's own, followed by 2
    assert d.draft(0, limit=1) == [2]
    assert d.draft(0, limit=0) == []


def test_no_match_no_draft_and_a_rows_own_end_is_not_a_match():
    d = LookupDrafter([[1, 2, 3]], [0], max_draft=4)
    d.extend(0, [40, 41])
    assert d.draft(0) == []  # 41 never appeared before: nothing to continue
    d2 = LookupDrafter([[1, 2, 3]], [0], max_draft=4)
    assert d2.draft(0) == []  # the prompt's own final n-grams have no continuation yet


def test_siblings_share_drafts_other_questions_do_not():
    # rows 0 and 1 sample prompt 0; row 2 answers prompt 1, the same tokens (another soft prompt);
    # row 3 answers prompt 2, another question
    d = LookupDrafter([[1, 2], [1, 2], [1, 5]], [0, 0, 1, 2], max_draft=3)
    d.extend(0, [30, 31, 32, 33])
    d.extend(1, [30])
    assert d.draft(1) == [31, 32, 33]  # its sibling's text
    d.extend(2, [30])
    assert d.draft(2) == [31, 32, 33]  # same question: the rollouts' text helps its answer
    d.extend(3, [30])
    assert d.draft(3) == []  # prompt 2 never saw what the other question's rows wrote


def test_max_draft_must_be_positive():
    with pytest.raises(ValueError, match="max_draft"):
        LookupDrafter([[1]], [0], max_draft=0)
