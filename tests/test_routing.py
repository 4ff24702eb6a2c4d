"""Notebook 07's routing: requests with known answers, scoring that can only answer with a candidate, the
cascade's arithmetic, and the runtime check on written JSON."""
from __future__ import annotations

import pytest

import infopt_lab as lab
from infopt_lab.bench import routing


def test_requests_are_seeded_distinct_and_hold_their_answer():
    a, b = routing.tool_requests(8, 5, seed=3), routing.tool_requests(8, 5, seed=3)
    assert a == b and a != routing.tool_requests(8, 5, seed=4)
    for r in a:
        assert len(r.tools) == len(set(r.tools)) == 5 and 0 <= r.answer < 5
        assert "(" in r.tools[r.answer] and r.text and r.names()[r.answer] == r.tools[r.answer].split("(")[0]
    assert len({r.tools[r.answer] for r in a}) == 8
    with pytest.raises(ValueError, match="documented tools"):
        routing.tool_requests(10_000)


def test_scoring_answers_with_a_candidate_and_a_model_routes_better_than_chance():
    model, tok = lab.load_model("target")
    requests = routing.tool_requests(10, 4, seed=0)
    scores = routing.score(model, tok, requests[0])
    assert len(scores) == 4 and all(s < 0 for s in scores)
    scored = routing.classify(model, tok, requests)
    assert all(0 <= c < 4 for c in scored.choices) and all(m >= 0 for m in scored.margins)
    assert scored.accuracy(requests) > 0.25 + 0.2          # chance is 1 in 4


def test_cascade_keeps_confident_small_answers_and_pays_for_the_rest():
    requests = [routing.Request("x", ("a()", "b()"), answer) for answer in (0, 1, 0)]
    small = routing.Scored([0, 0, 1], [5.0, 0.5, 2.0], [1.0, 1.0, 1.0])
    big = routing.Scored([0, 1, 0], [9.0, 9.0, 9.0], [10.0, 10.0, 10.0])
    for threshold, want in [(0.0, (1 / 3, 0.0, 3.0)), (1.0, (2 / 3, 1 / 3, 13.0)), (6.0, (1.0, 1.0, 33.0))]:
        got = routing.cascade(small, big, requests, threshold)
        assert (got.accuracy, got.escalated, got.seconds) == pytest.approx(want), threshold


def test_the_runtime_check_passes_only_a_named_candidate_in_json():
    r = routing.Request("x", ("open_file(path)", "close(self)"), 0)
    assert routing.checked_tool('Sure:\n```json\n{"tool": "open_file"}\n```', r) == "open_file"
    for text in ['{"tool": "open_file(path)"}', '{"tool": "delete_all"}', 'The tool is "open_file".',
                 '{"tool": "open_file"', '["open_file"]', '{"name": "open_file"}', '{"tool": "one of the tools"}']:
        assert routing.checked_tool(text, r) is None, text
