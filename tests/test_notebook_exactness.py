"""Every notebook cell that asserts identical tokens does so in invariant mode, or in the default mode only where
`lab.exact_tokens` says it is exact, with the reason printed earlier in the notebook (the rule of exactness).

`test_the_asserting_cells_are_the_ones_we_know` lists them; a new one must be added there, on purpose.
"""
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
TOKEN_CLAIM = re.compile(r"\btoken_ids\b(?!\s*\))|\b\w*same\w*\b")   # token lists compared (not just counted)

# asserts that compare one computation with itself, so no row count changes between the two sides
SAME_COMPUTATION = {
    ("00", "run_a.token_ids == run_b.token_ids"): "the same seeded generate twice: the same calls, row for row",
    ("00", "greedy.token_ids[0] == top.indices[0].item()"): "both the top-1 of one pass over the same prompt rows",
}

# the cells that assert identical tokens, as (notebook, anchor in the assert line): the list this test keeps
KNOWN = {
    ("01", "assert c.same_tokens"), ("03", "assert all(same_alone)"), ("03", "assert cont.token_ids == static"),
    ("03", "assert same_tight"), ("03", "assert same"), ("03", "assert s_same"),
    ("05", "assert run.token_ids == alone.token_ids"), ("05", "assert all(same for _, same in rows)"),
    ("05", 'assert runs[f"k={k}"].token_ids'), ("05", "assert lk.token_ids == lb.token_ids"),
    ("05", "assert r.token_ids == real_base.token_ids"), ("05", "assert all(p.same_tokens for p in points)"),
    ("06", "assert all(r.token_ids == a[:len(r.token_ids)]"),
}


def same_computation(notebook: str, line: str) -> bool:
    """An assert SAME_COMPUTATION names (it compares one computation with itself)."""
    return any(nb == notebook and line.strip().startswith(f"assert {expr}") for nb, expr in SAME_COMPUTATION)


def code_only(line: str) -> str:
    """A source line without its string literals and comment (what the line computes, not what it says)."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.sub(r"#.*", "", line)
    return " ".join(t.string for t in toks if t.type not in (tokenize.STRING, tokenize.COMMENT))


def token_asserts(path: Path) -> list[tuple[int, str, str]]:
    """(cell index, the assert line, the cell's source) for every assert about tokens being the same."""
    cells = json.loads(path.read_text())["cells"]
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        for line in source.splitlines():
            code = code_only(line)
            if re.match(r"\s*assert\b", code) and TOKEN_CLAIM.search(code):
                found.append((i, line, source))
    return found


def guarded(line: str, source: str) -> bool:
    """The assert runs in invariant mode (the cell passes batch_invariant=) or only where the default is exact."""
    lines = source.splitlines()
    at = lines.index(line)
    above = next((s for s in reversed(lines[:at]) if s.strip()), "")
    return "batch_invariant=" in source or ("in_default_mode" in above and len(line) - len(line.lstrip()) >
                                            len(above) - len(above.lstrip()))


def reason_printed_before(path: Path, index: int) -> bool:
    """Some earlier cell (or this one) prints an `exact_tokens(...).reason`."""
    cells = json.loads(path.read_text())["cells"]
    return any("exact_tokens(" in "".join(c["source"]) and ".reason" in "".join(c["source"])
               for c in cells[:index + 1] if c["cell_type"] == "code")


CASES = [(p, i, line, src) for p in NOTEBOOKS for i, line, src in token_asserts(p)]


def case_id(case) -> str:
    path, i, line, _ = case
    return f"{path.parent.name}/{path.name[:2]}:cell{i}:{line.strip()[:40]}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_each_identical_tokens_assert_follows_the_rule(case):
    path, index, line, source = case
    if same_computation(path.name[:2], line):
        return
    assert guarded(line, source), (f"{case_id(case)}: assert identical tokens with batch_invariant=exact.batch_invariant "
                                   "or under `if exact.in_default_mode:`")
    assert reason_printed_before(path, index), f"{case_id(case)}: print lab.exact_tokens(model).reason before it"


def test_the_asserting_cells_are_the_ones_we_know():
    found = {(p.name[:2], line.strip()) for p, _, line, _ in CASES
             if p.parent.name == "notebooks" and not same_computation(p.name[:2], line)}
    known = {(nb, anchor.strip()) for nb, anchor in KNOWN}
    matched = {f for f in found if any(f[0] == nb and f[1].startswith(a) for nb, a in known)}
    assert matched == found, f"new identical-token asserts, add them to KNOWN: {sorted(found - matched)}"
    missing = {k for k in known if not any(f[0] == k[0] and f[1].startswith(k[1]) for f in found)}
    assert not missing, f"identical-token asserts no longer found, update KNOWN: {sorted(missing)}"


def test_the_rule_check_fails_on_an_unguarded_assert():
    source = 'out = lab.generate(model, tok, "x", max_new_tokens=4)\nassert out.token_ids == other.token_ids\n'
    assert not guarded("assert out.token_ids == other.token_ids", source)
    guarded_source = "if exact.in_default_mode:\n    assert out.token_ids == other.token_ids\n"
    assert guarded("    assert out.token_ids == other.token_ids", guarded_source)
    assert code_only('assert draws == x, "the same seed"').count("same") == 0
