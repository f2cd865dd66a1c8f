"""Reading the DOT files ``Graph.debug_dump`` writes: its nodes and edges, whatever else the
writer puts in them (a GPU's driver writes more attributes than the stand-in or a virtual
device), so that a test asserts the same shape on every backend."""

from __future__ import annotations

import re

#: a quoted string (with its escapes), an arrow, a bracket, or a bare identifier
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|->|[\[\]{};=]|[A-Za-z0-9_.]+', re.DOTALL)
_KEYWORDS = {"graph", "node", "edge", "subgraph", "digraph", "strict"}


def parse(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The node statements' ids, in order, and the edges ``(from, to)`` of a DOT text; every
    node an edge names must have a statement of its own (the driver's output has one)."""
    tokens = _TOKEN.findall(text)
    nodes: list[str] = []
    edges: list[tuple[str, str]] = []
    for i, token in enumerate(tokens):
        before = tokens[i - 1] if i else ";"
        after = tokens[i + 1] if i + 1 < len(tokens) else ";"
        if token == "->":
            edges.append((_id(before), _id(after)))
        elif (
            after == "["
            and before not in ("->", "=")
            and token not in _KEYWORDS
            and token not in "[]{};="
        ):
            nodes.append(_id(token))
    return nodes, edges


def _id(token: str) -> str:
    return token[1:-1] if token.startswith('"') else token
