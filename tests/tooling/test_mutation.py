"""tools/mutation.py's bookkeeping of known survivors: which of a run's mutants KNOWN explains,
which are left to look at, and which entries are stale (pure functions; no mutmut run)."""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

from tests.helpers.process import ROOT


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "tools/mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tool = _tool()
PATH = "aiostream/x.py"


def mutant(before: str, after: str, status: str = "survived", **kw: str) -> object:
    fields = {"name": "aiostream.x.xǁAǁf__mutmut_1", "path": PATH, "function": "A.f"} | kw
    return tool.Mutant(
        fields["name"],
        fields["path"],
        fields["function"],
        3,
        before,
        after,
        status,
        fields.get("above", ""),
    )


FLAG = tool.Known(PATH, "A.f", "self.flag = False", "False -> None", "read for truth only")


def test_describe_gives_the_tokens_that_differ() -> None:
    assert tool.describe("self.flag = False  # note", "self.flag = None  # note") == (
        "False -> None"
    )
    assert tool.describe("x += 1", "x += 2") == "1 -> 2"
    assert tool.describe("zip(a, b, strict=True)", "zip(a, b, )") == "strict = True -> "
    assert tool.describe('k == "stream"', 'k == "XXstreamXX"') == '"stream" -> "XXstreamXX"'


def test_a_known_survivor_is_explained_whatever_its_spacing_and_comments() -> None:
    m = mutant("    self.flag   = False  # a comment", "    self.flag = None")
    verdict = tool.subtract([m], [FLAG])
    assert verdict.unexplained == [] and verdict.explained == [(m, FLAG)]
    assert verdict.stale == []


def test_a_survivor_not_in_the_data_is_to_look_at() -> None:
    other = mutant("self.flag = False", "self.flag = True")  # another change
    elsewhere = mutant("self.flag = False", "self.flag = None", function="A.g")
    line = mutant("self.other = False", "self.other = None")  # another line
    verdict = tool.subtract([other, elsewhere, line], [FLAG])
    assert verdict.unexplained == [other, elsewhere, line]
    assert verdict.explained == []


def test_the_change_must_be_inside_the_code_named() -> None:
    known = tool.Known(PATH, "A.f", "now, 0", "0 -> 1", "never read")
    first = mutant("Item(0, s, now, 0, None)", "Item(1, s, now, 0, None)")
    fourth = mutant("Item(0, s, now, 0, None)", "Item(0, s, now, 1, None)")
    verdict = tool.subtract([first, fourth], [known])
    assert verdict.unexplained == [first] and verdict.explained == [(fourth, known)]


def test_the_lines_above_tell_twin_lines_apart() -> None:
    known = tool.Known(PATH, "A.f", "m = M(n)", "n -> None", "unread", above='"pooled"')
    pooled = mutant("m = M(n)", "m = M(None)", above='p = check("pooled")')
    plain = mutant("m = M(n)", "m = M(None)", above='p = check("plain")')
    verdict = tool.subtract([pooled, plain], [known])
    assert verdict.unexplained == [plain] and verdict.explained == [(pooled, known)]


def test_killed_and_unchecked_mutants_are_neither_explained_nor_to_look_at() -> None:
    for status in ("killed", "timeout", "not checked", "error"):
        verdict = tool.subtract([mutant("self.flag = False", "self.flag = None", status)], [FLAG])
        assert verdict.unexplained == [] and verdict.explained == []


def test_an_entry_that_matches_no_mutant_of_its_file_is_stale() -> None:
    changed = mutant("self.flag = 0", "self.flag = None")  # the code changed under the entry
    verdict = tool.subtract([changed], [FLAG])
    assert verdict.unexplained == [changed]
    assert [(k, why.split(":")[0]) for k, why in verdict.stale] == [(FLAG, "matches no mutant")]
    # a file not mutated in the run says nothing of its entries
    assert tool.subtract([], [FLAG]).stale == []
    assert len(tool.subtract([], [FLAG], {PATH}).stale) == 1


def test_an_entry_whose_mutant_is_killed_now_is_stale() -> None:
    killed = mutant("self.flag = False", "self.flag = None", "killed")
    verdict = tool.subtract([killed], [FLAG])
    assert [k for k, why in verdict.stale if why.startswith("killed")] == [FLAG]
    # one not checked this run (a sample): not stale
    assert (
        tool.subtract(
            [mutant("self.flag = False", "self.flag = None", "not checked")], [FLAG]
        ).stale
        == []
    )


def test_the_report_lists_what_to_look_at_and_the_stale_entries() -> None:
    m = mutant("x += 1", "x -= 1")
    lines = tool.report_lines(tool.Verdict([m], [], [(FLAG, "killed: n")]))
    assert lines[0].split() == ["survived", f"{PATH}:3", m.name]
    assert "'+= -> -='" in lines[1] and lines[2:4] == ["    -x += 1", "    +x -= 1"]
    assert lines[4].startswith("stale") and "killed: n" in lines[4]


def test_every_entry_of_known_is_complete() -> None:
    for k in tool.KNOWN:
        assert k.path.startswith("aiostream/") and (ROOT / k.path).is_file(), k
        assert "->" in k.change and k.reason and k.function, k
        old = tool.tokens(k.change.partition("->")[0])
        code = tool.tokens(k.code)
        assert any(code[i : i + len(old)] == old for i in range(len(code))), k


def test_no_mutant_is_excused_in_the_code_shape() -> None:
    # a pragma sits on the one line whose every mutant is equivalent, never on a bracket
    # opened to reach the next line; the other equivalent mutants are entries of KNOWN
    excuse = re.compile(r"equivalent mutant|equivalent under mutation|eq\. mutant", re.I)
    found = []
    for path in sorted((ROOT / "aiostream").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            code, _, comment = line.partition("#")
            if "pragma: no mutate" in comment and code.rstrip().endswith(("(", "[", "{", "\\")):
                found.append(f"{where}: a pragma over more than one line")
            if excuse.search(comment):
                found.append(f"{where}: an excuse comment (make it an entry of KNOWN)")
    assert found == []
