"""A chat template as a fixed pattern: render each conversation shape once, paste the contents in.

Most chat templates read a message's content only to print it. When that is provable from the
template's syntax tree, the rendered text is a function of the roles alone with every content
pasted in, and the template needs rendering once per sequence of roles (a chat set has a few
dozen), not once per record::

    roles ("system", "user", "assistant"), rendered with sentinel contents S0, S1, S2:
      "<s>[INST] S0\\n\\nS1 [/INST] S2</s>"   ->  literal, slot 0, literal, slot 1, literal, slot 2, literal
    a record with those roles: the same literals with its three contents in the slots.

``analyse`` proves it (``TemplateShape.reason`` says why not): the content of a message may
reach the output verbatim (``{{ m['content'] }}``, joined with ``+`` or ``~``, through
``{% set x = m['content'] %}``) or trimmed (``| trim``), and may be tested with ``is string`` /
``is defined`` / ``is none`` (the same answer for every string); nothing else sees it: no ``if``,
comparison, ``length``, slice, method, other filter or whole-message use (``m | tojson``). The
control flow then depends on the roles and the number of messages only, so two conversations
with the same roles take the same path through the template and print the same literals.

The skeleton is rendered as transformers' own renderer renders it (``chat_render``: the environment and
the call of ``render_jinja_template``, which ``apply_chat_template`` makes, tested equal), so literals and
``{% generation %}`` spans are transformers'.
A sentinel is ``PAD OPEN index CLOSE PAD`` with private-use characters a template never holds
(checked); a slot printed with its pads is verbatim, one printed without is trimmed (``trim``
strips the pads, which are whitespace), anything else is refused. Messages reach the template
as ``{"role", "content": str}`` only (``chat.chat_messages`` normalises them; a record whose assistant turn has
``thinking`` is rendered by Jinja, one at a time: ``tokenizer.HFTokenizer.encode_samples``), so no other field
varies between records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PAD, OPEN, CLOSE = "\u3000", "\ue000", "\ue001"
_SLOT = re.compile(f"({PAD}?){OPEN}(\\d+){CLOSE}({PAD}?)")

PLAIN, CONTENT, TEXT, MESSAGE, MESSAGES = "plain", "content", "text", "message", "messages"
"""Kinds of a template value: free of contents; one content; text holding contents; a message; a list of them."""

_SAFE_TESTS = {CONTENT: {"string", "defined", "undefined", "none"}, TEXT: {"string", "defined", "undefined", "none"},
               MESSAGE: {"defined", "undefined", "mapping", "none"}, MESSAGES: {"defined", "undefined", "sequence",
                                                                                 "iterable", "none"}}
_PLAIN_CALLS = {"raise_exception", "namespace", "range", "dict", "strftime_now", "lipsum", "cycler", "joiner"}


class Unsupported(Exception):
    """The template uses a content in a way the pattern cannot reproduce; ``str`` says where."""


class _Analyser:
    def __init__(self, nodes):
        self.n = nodes
        self.names: dict[str, str] = {"messages": MESSAGES}

    def bind(self, name: str, kind: str) -> None:
        """Record what ``name`` holds; a name that holds text with and without contents holds text."""
        old = self.names.get(name, kind)
        if old != kind and {old, kind} <= {PLAIN, CONTENT, TEXT} and name != "messages":
            kind = TEXT
        elif old != kind:
            raise Unsupported(f"'{name}' holds both a {old} and a {kind}")
        self.names[name] = kind

    def known(self, test) -> bool | None:
        """The value of an ``if`` test that only asks whether a content is a string (always: contents
        are normalised to strings), else None; the branch never taken is then not analysed."""
        n = self.n
        if isinstance(test, n.Not):
            inner = self.known(test.node)
            return None if inner is None else not inner
        if isinstance(test, n.Test) and not test.args and test.name in ("string", "defined", "undefined", "none"):
            try:
                kind = self.expr(test.node)
            except Unsupported:
                return None
            if kind == CONTENT:
                return test.name in ("string", "defined")
        return None

    def plain(self, node, what: str) -> None:
        kind = self.expr(node)
        if kind != PLAIN:
            raise Unsupported(f"{what} reads a message's {kind} (line {node.lineno})")

    def expr(self, node) -> str:  # noqa: C901 (one case per node type)
        n = self.n
        if isinstance(node, (n.Const, n.TemplateData)):
            return PLAIN
        if isinstance(node, n.Name):
            return self.names.get(node.name, PLAIN)
        if isinstance(node, n.Getitem):
            base = self.expr(node.node)
            if base == MESSAGES:
                if isinstance(node.arg, n.Slice):
                    for part in (node.arg.start, node.arg.stop, node.arg.step):
                        if part is not None:
                            self.plain(part, "a slice of messages")
                    return MESSAGES
                self.plain(node.arg, "an index into messages")
                return MESSAGE
            if base == MESSAGE:
                if not isinstance(node.arg, n.Const):
                    raise Unsupported(f"a message key is computed (line {node.lineno})")
                return CONTENT if node.arg.value == "content" else PLAIN
            if base != PLAIN:
                raise Unsupported(f"a {base} is indexed (line {node.lineno})")
            self.plain(node.arg, "an index")
            return PLAIN
        if isinstance(node, n.Getattr):
            base = self.expr(node.node)
            if base == MESSAGE:
                return CONTENT if node.attr == "content" else PLAIN
            if isinstance(node.node, n.Name) and node.node.name == "loop" and node.attr in ("previtem", "nextitem",
                                                                                            "cycle"):
                raise Unsupported(f"loop.{node.attr} (line {node.lineno})")
            if base != PLAIN:
                raise Unsupported(f"an attribute of a {base} is read (line {node.lineno})")
            return PLAIN
        if isinstance(node, n.Filter):
            self._plain_args(node)
            base = PLAIN if node.node is None else self.expr(node.node)
            if base == PLAIN:
                return PLAIN
            if base == MESSAGES and node.name in ("length", "count"):
                return PLAIN
            if base == MESSAGES and node.name in ("first", "last"):
                return MESSAGE
            if base == CONTENT and node.name == "trim" and not node.args and not node.kwargs:
                return CONTENT
            raise Unsupported(f"filter '{node.name}' on a {base} (line {node.lineno})")
        if isinstance(node, n.Test):
            self._plain_args(node)
            base = self.expr(node.node)
            if base == PLAIN or node.name in _SAFE_TESTS.get(base, ()):
                return PLAIN
            raise Unsupported(f"test '{node.name}' on a {base} (line {node.lineno})")
        if isinstance(node, (n.Add, n.Concat)):
            parts = [node.left, node.right] if isinstance(node, n.Add) else node.nodes
            kinds = {self.expr(p) for p in parts}
            if kinds & {MESSAGE, MESSAGES}:
                raise Unsupported(f"messages are joined to text (line {node.lineno})")
            return TEXT if kinds & {CONTENT, TEXT} else PLAIN
        if isinstance(node, n.CondExpr):
            known = self.known(node.test)
            if known is None:
                self.plain(node.test, "an inline if")
            branches = [node.expr1] if known is True else [node.expr2] if known is False else [node.expr1, node.expr2]
            kinds = {PLAIN if b is None else self.expr(b) for b in branches}
            if kinds <= {PLAIN}:
                return PLAIN
            if kinds <= {PLAIN, CONTENT, TEXT}:
                return TEXT
            raise Unsupported(f"an inline if chooses a message (line {node.lineno})")
        if isinstance(node, n.Call):
            self._plain_args(node)
            callee = node.node
            if isinstance(callee, n.Name) and callee.name in _PLAIN_CALLS:
                return PLAIN
            if isinstance(callee, n.Getattr) and self.expr(callee.node) == PLAIN:
                return PLAIN
            raise Unsupported(f"a call on a message or content (line {node.lineno})")
        if isinstance(node, (n.Compare, n.Operand, n.BinExpr, n.UnaryExpr, n.List, n.Tuple, n.Dict, n.Pair,
                             n.Keyword, n.Slice)):
            for child in node.iter_child_nodes():
                self.plain(child, "an operator or literal")
            return PLAIN
        raise Unsupported(f"{type(node).__name__} (line {node.lineno})")

    def _plain_args(self, node) -> None:
        for arg in [*node.args, *(k.value for k in node.kwargs), node.dyn_args, node.dyn_kwargs]:
            if arg is not None:
                self.plain(arg, f"an argument of {getattr(node, 'name', 'a call')}")

    def stmts(self, body) -> None:
        for node in body:
            self.stmt(node)

    def stmt(self, node) -> None:  # noqa: C901 (one case per statement type)
        n = self.n
        if isinstance(node, n.Output):
            for child in node.nodes:
                if self.expr(child) in (MESSAGE, MESSAGES):
                    raise Unsupported(f"a message is printed whole (line {child.lineno})")
        elif isinstance(node, n.If):
            known = self.known(node.test)
            if known is None:
                self.plain(node.test, "an if")
            if known is not False:
                self.stmts(node.body)
            if known is not True:
                for i, elif_ in enumerate(node.elif_):  # the rest of the chain is the else of this elif
                    self.stmt(n.If(elif_.test, elif_.body, node.elif_[i + 1:], node.else_, lineno=elif_.lineno))
                    break
                else:
                    self.stmts(node.else_)
        elif isinstance(node, n.For):
            if node.recursive:
                raise Unsupported(f"a recursive loop (line {node.lineno})")
            kind = self.expr(node.iter)
            if kind == MESSAGES and isinstance(node.target, n.Name):
                self.bind(node.target.name, MESSAGE)
            elif kind == PLAIN:
                for target in node.target.find_all(n.Name):
                    self.bind(target.name, PLAIN)
            else:
                raise Unsupported(f"a loop over a {kind} (line {node.lineno})")
            if node.test is not None:
                self.plain(node.test, "a loop filter")
            self.stmts(node.body)
            self.stmts(node.else_)
        elif isinstance(node, n.Assign):
            kind = self.expr(node.node)
            if isinstance(node.target, n.Name):
                self.bind(node.target.name, kind)
            elif kind != PLAIN:
                raise Unsupported(f"a {kind} is stored in a namespace or tuple (line {node.lineno})")
            else:
                for target in node.target.find_all(n.Name):
                    self.bind(target.name, PLAIN)
        elif isinstance(node, n.CallBlock) and isinstance(node.call.node, n.ExtensionAttribute) \
                and node.call.node.name == "_generation_support":
            self.stmts(node.body)
        elif isinstance(node, (n.Continue, n.Break)):
            pass
        else:
            raise Unsupported(f"{type(node).__name__} (line {node.lineno})")


@dataclass(frozen=True)
class TemplateShape:
    """What ``analyse`` found: ``reason`` is None when the template is a fixed pattern."""

    reason: str | None

    @property
    def fixed(self) -> bool:
        return self.reason is None


def analyse(template: str) -> TemplateShape:
    """Whether ``template`` prints contents only verbatim or trimmed and never branches on them."""
    import jinja2
    from jinja2 import nodes
    from megatron_pack.data.formats.chat_render import compile_template

    if any(c in template for c in (PAD, OPEN, CLOSE)):
        return TemplateShape("the template holds the sentinel characters")
    env = compile_template(template).environment
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        return TemplateShape(f"syntax error: {exc}")
    analyser = _Analyser(nodes)
    try:
        for _ in range(3):  # names assigned below their first use: iterate until their kinds settle
            before = dict(analyser.names)
            analyser.stmts(tree.body)
            if analyser.names == before:
                break
        else:
            raise Unsupported("the kinds of the template's variables do not settle")
    except Unsupported as exc:
        return TemplateShape(str(exc))
    return TemplateShape(None)


@dataclass(frozen=True)
class Skeleton:
    """One conversation shape: ``parts`` are literal strings or ``(message index, trimmed)`` slots;
    ``spans`` are the ``{% generation %}`` spans as ``(first part, end part)`` (literals are cut at
    every span boundary, so a span always covers whole parts)."""

    parts: tuple
    spans: tuple

    def layout(self, contents: list[str]) -> tuple[str, list[int]]:
        """The rendered text with ``contents`` in the slots, and where each part starts in it (one
        more entry: the end)."""
        pieces, starts, pos = [], [], 0
        for part in self.parts:
            piece = part if isinstance(part, str) else contents[part[0]].strip() if part[1] else contents[part[0]]
            starts.append(pos)
            pieces.append(piece)
            pos += len(piece)
        starts.append(pos)
        return "".join(pieces), starts

    def fill(self, contents: list[str]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with ``contents`` in the slots, and the generation spans in it."""
        text, starts = self.layout(contents)
        return text, [(starts[a], starts[b]) for a, b in self.spans]

    def prefix_cut(self, prefix: "Skeleton") -> tuple[int, int] | None:
        """``(k, extra)`` such that ``prefix`` renders, for any contents, exactly the first
        ``starts[k] + extra`` characters of this skeleton's text; None when that does not hold
        for every content (the caller then compares texts).

        >>> Skeleton(("<s>[INST]", (0, False), "[/INST]", (1, False)), ()).prefix_cut(
        ...     Skeleton(("<s>[INST]", (0, False), "[/IN"), ()))
        (2, 4)
        """
        n = len(prefix.parts)
        if n == 0:
            return (0, 0)
        if n > len(self.parts) or self.parts[:n - 1] != prefix.parts[:n - 1]:
            return None
        mine, theirs = self.parts[n - 1], prefix.parts[n - 1]
        if mine == theirs:
            return (n, 0)
        if isinstance(mine, str) and isinstance(theirs, str) and mine.startswith(theirs):
            return (n - 1, len(theirs))
        return None


def build_skeleton(render, roles: tuple[str, ...], add_generation_prompt: bool) -> Skeleton:
    """Render the shape ``roles`` once with sentinel contents (``render(messages, add_generation_prompt)``
    returns ``(text, spans)``) and cut it into literals and slots. Raises ``Unsupported``.

    >>> render = lambda m, g: ("<s>" + "".join(f"[{x['role']}]{x['content'].strip()}" for x in m), [])
    >>> build_skeleton(render, ("user",), False).parts
    ('<s>[user]', (0, True))
    """
    messages = [{"role": r, "content": f"{PAD}{OPEN}{i}{CLOSE}{PAD}"} for i, r in enumerate(roles)]
    text, spans = render(messages, add_generation_prompt)
    cuts = sorted({p for span in spans for p in span} | {0, len(text)})
    parts, part_at, pos = [], {}, 0

    def literal(stop: int) -> None:
        for a, b in zip([pos] + [c for c in cuts if pos < c < stop], [c for c in cuts if pos < c < stop] + [stop]):
            if b > a:
                part_at[a] = len(parts)
                parts.append(text[a:b])

    for match in _SLOT.finditer(text):
        literal(match.start())
        pad_left, index, pad_right = match.groups()
        if bool(pad_left) != bool(pad_right) or int(index) >= len(roles):
            raise Unsupported("a content was cut or changed by the template")
        if any(match.start() < c < match.end() for c in cuts):
            raise Unsupported("a generation span starts or ends inside a content")
        part_at[match.start()] = len(parts)
        parts.append((int(index), not pad_left))
        pos = match.end()
    literal(len(text))
    part_at[len(text)] = len(parts)
    if any(c in p for p in parts if isinstance(p, str) for c in (PAD, OPEN, CLOSE)):
        raise Unsupported("a sentinel character survived outside a slot")
    return Skeleton(tuple(parts), tuple((part_at[a], part_at[b]) for a, b in spans))
