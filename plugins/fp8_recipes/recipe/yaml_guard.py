"""The one guarded YAML reader: every recipe and run file this project reads goes through :func:`load_yaml`.

    data = load_yaml(path.read_bytes(), source=str(path))     # plain Python data, or UnsafeYAML (one line)

PyYAML's ``safe_load`` already refuses ``!!python/...`` objects, but it accepts what hangs or misleads later:
an alias bomb (a 481-byte file whose aliases expand to billions of nodes when OmegaConf or a printer walks it),
duplicate keys (the last one silently wins), several documents (the first silently wins), invalid UTF-8, unknown
tags, and unbounded size or depth. This reader refuses each in one line naming the line of the file and the fix,
before any object is built. Imports nothing of ours (the bottom floor: schema and recipes sit on it).
"""

from __future__ import annotations

from typing import Any

import yaml

from fp8_recipes.checks import ConfigError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "UnsafeYAML", "load_yaml"]

MAX_BYTES = 1 << 20      # a recipe or run file is a few kB; 1 MiB leaves room for anything real
MAX_DEPTH = 32           # recipes nest three levels (roles -> policy -> block)
MAX_NODES = 100_000      # nodes after expanding every alias once per use (the alias-bomb measure)
_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp",
                                            "binary", "omap", "pairs", "set", "merge")}


class UnsafeYAML(ConfigError):
    """A YAML input refused by :func:`load_yaml`: ``str(e)`` is one line, ``e.line`` the 1-based line (or None)."""

    def __init__(self, problem: str, line: int | None = None):
        self.line = line
        super().__init__(f"{'line ' + str(line) + ': ' if line else ''}{problem}")


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _check(root: yaml.Node) -> None:
    """Depth, expanded size (aliases counted at every use, memoized per node), tags and duplicate keys."""
    size: dict[int, int] = {}
    open_: set[int] = set()  # nodes being walked: an alias to one of them is a recursive structure

    def walk(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise UnsafeYAML(f"nested deeper than {MAX_DEPTH} levels; a recipe is a few levels of keys", _line(node))
        if node.tag not in _TAGS:
            raise UnsafeYAML(f"unknown tag {node.tag!r}; remove it (plain YAML values only)", _line(node))
        key = id(node)
        if key in size:  # an alias: the same node again, at its full size
            return size[key]
        if key in open_:
            raise UnsafeYAML("an alias refers to a value that contains it (a recursive structure); write it out",
                             _line(node))
        open_.add(key)
        n = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.value in seen and k.tag != "tag:yaml.org,2002:merge":
                        raise UnsafeYAML(f"duplicate key {k.value!r} (first at line {seen[k.value]}); keep one",
                                         _line(k))
                    seen[k.value] = _line(k)
                n += walk(k, depth + 1) + walk(v, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(walk(item, depth + 1) for item in node.value)
        size[key] = n
        open_.discard(key)
        if n > MAX_NODES:
            raise UnsafeYAML(f"expands to more than {MAX_NODES:,} values (aliases repeated inside aliases?); "
                             f"write the values out", _line(node))
        return n

    walk(root, 0)


def load_yaml(raw: bytes | str, source: str = "<yaml>") -> Any:
    """Plain Python data from one YAML document, or :class:`UnsafeYAML` (one line) for anything refused above or
    a syntax error. ``raw``: the file's bytes (its encoding is checked) or text."""
    if isinstance(raw, bytes):
        if len(raw) > MAX_BYTES:
            raise UnsafeYAML(f"{len(raw):,} bytes is more than a recipe or run file holds ({MAX_BYTES:,} at most)")
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = raw[:e.start].count(b"\n") + 1
            raise UnsafeYAML(f"not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); save the file as UTF-8",
                             line) from None
    else:
        text = raw
        if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
            raise UnsafeYAML(f"more than {MAX_BYTES:,} bytes; a recipe or run file is a few kB")
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UnsafeYAML(f"YAML syntax error: {problem}; fix the YAML", mark.line + 1 if mark else None) from None
    if len(nodes) > 1:
        raise UnsafeYAML(f"{len(nodes)} YAML documents ('---' separators); a recipe or run file is one",
                         _line(nodes[1]))
    if not nodes or nodes[0] is None:
        return None
    _check(nodes[0])
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(nodes[0])
    except yaml.YAMLError as e:  # e.g. a malformed timestamp or merge key
        mark = getattr(e, "problem_mark", None)
        raise UnsafeYAML(f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}; fix the YAML",
                         mark.line + 1 if mark else None) from None
    finally:
        loader.dispose()
