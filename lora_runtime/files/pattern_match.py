"""PEFT's ``alpha_pattern`` / ``rank_pattern`` keys, matched with bounded cost.

PEFT picks the first key ``k`` (in the config's order) for which
``re.match(rf"(.*\\.)?({k})$", module_name)`` succeeds: the key, read as a regular
expression, matches the whole module path or a suffix of it that starts after a dot.
Python's ``re`` backtracks, so a key with nested or stacked quantifiers
(``(a+)+b``, ``a*a*a*a*b``) can take exponential time on a path it does not match.

Here the key is parsed with Python's own regex parser (same syntax, same meaning) and
compiled to a Thompson automaton that is simulated over the path in one pass: the cost
is at most (path length) x (automaton states), whatever the key. Supported: literals,
``.``, character classes and ``\\d \\w \\s`` (and their negations), groups (capturing or
not), alternation, greedy and lazy quantifiers (laziness changes no yes/no answer),
``^`` and ``$``. Refused with `PatternError` naming the key: back-references,
look-around, atomic groups / possessive quantifiers, inline flags such as ``(?i)``,
word boundaries, and keys whose automaton would exceed `MAX_STATES` states (a counted
repeat such as ``x{1000}`` nested in another). The work of all the matches of one config
is also bounded (`Budget`): beyond it the key that spent it is refused.
"""
from __future__ import annotations

import re

try:  # Python >= 3.11
    from re import _constants as _c
    from re import _parser as _p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

MAX_KEY_CHARS = 1000
MAX_STATES = 4000

# state kinds
_CHAR, _SPLIT, _BEGIN, _END, _MATCH = range(5)


class PatternError(ValueError):
    """A pattern key outside the supported subset, or not a valid regular expression."""


MAX_WORK = 50_000_000   # automaton state visits for all the matches of one config


class Budget:
    """Automaton steps left for the matches of one config."""

    def __init__(self, steps: int = MAX_WORK):
        self.left = steps

    def spend(self, n: int, key: str) -> None:
        self.left -= n
        if self.left < 0:
            raise PatternError(f"matching it against the adapter's layers takes more than {MAX_WORK} automaton "
                               "steps; use a simpler pattern")


def _category(cat) -> callable:
    table = {
        _c.CATEGORY_DIGIT: str.isdecimal,
        _c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
        _c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
        _c.CATEGORY_NOT_WORD: lambda ch: not (ch.isalnum() or ch == "_"),
        _c.CATEGORY_SPACE: str.isspace,
        _c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    }
    if cat not in table:
        raise PatternError(f"character category {cat} is not supported")
    return table[cat]


def _char_class(items) -> callable:
    negate = False
    tests = []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            tests.append(lambda ch, c=chr(av): ch == c)
        elif op is _c.RANGE:
            tests.append(lambda ch, lo=av[0], hi=av[1]: lo <= ord(ch) <= hi)
        elif op is _c.CATEGORY:
            tests.append(_category(av))
        else:
            raise PatternError(f"{op} inside a character class is not supported")
    if negate:
        return lambda ch: not any(t(ch) for t in tests)
    return lambda ch: any(t(ch) for t in tests)


class _Builder:
    """Thompson construction: each fragment is (start state, list of dangling exits)."""

    def __init__(self):
        self.kind: list[int] = []
        self.data: list = []        # the predicate of a _CHAR state
        self.out: list[list[int]] = []

    def state(self, kind, data=None) -> int:
        if len(self.kind) >= MAX_STATES:
            raise PatternError(f"it needs more than {MAX_STATES} automaton states (a large counted repeat)")
        self.kind.append(kind)
        self.data.append(data)
        self.out.append([])
        return len(self.kind) - 1

    def patch(self, exits, target: int) -> None:
        for s in exits:
            self.out[s].append(target)

    # a fragment: (start, exits) where exits are states whose out list still needs a target
    def seq(self, items):
        start, exits = None, None
        for item in items:
            f = self.node(item)
            if f is None:
                continue
            if start is None:
                start, exits = f
            else:
                self.patch(exits, f[0])
                exits = f[1]
        if start is None:  # empty sequence: an epsilon state
            s = self.state(_SPLIT)
            return s, [s]
        return start, exits

    def node(self, item):
        op, av = item
        if op is _c.LITERAL:
            s = self.state(_CHAR, lambda ch, c=chr(av): ch == c)
            return s, [s]
        if op is _c.NOT_LITERAL:
            s = self.state(_CHAR, lambda ch, c=chr(av): ch != c)
            return s, [s]
        if op is _c.ANY:
            s = self.state(_CHAR, lambda ch: ch != "\n")
            return s, [s]
        if op is _c.IN:
            s = self.state(_CHAR, _char_class(av))
            return s, [s]
        if op is _c.AT:
            if av in (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING):
                s = self.state(_BEGIN)
            elif av in (_c.AT_END, _c.AT_END_STRING):
                s = self.state(_END)
            else:
                raise PatternError(f"the anchor {av} is not supported (only ^ and $)")
            return s, [s]
        if op is _c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise PatternError("inline flags such as (?i:...) are not supported")
            return self.seq(sub)
        if op is _c.BRANCH:
            split = self.state(_SPLIT)
            exits = []
            for alt in av[1]:
                s, e = self.seq(alt)
                self.out[split].append(s)
                exits += e
            return split, exits
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            lo, hi, sub = av
            return self.repeat(lo, hi, sub)
        raise PatternError(f"{str(op).lower()} is not supported (back-references, look-around, atomic groups "
                           "and possessive quantifiers are outside the supported subset)")

    def repeat(self, lo: int, hi, sub):
        start, exits = None, None

        def append(frag):
            nonlocal start, exits
            if start is None:
                start, exits = frag
            else:
                self.patch(exits, frag[0])
                exits = frag[1]

        for _ in range(lo):
            append(self.seq(sub))
        if hi is _c.MAXREPEAT:
            split = self.state(_SPLIT)
            s, e = self.seq(sub)
            self.out[split].append(s)
            self.patch(e, split)
            append((split, [split]))
        else:
            # (x(x(x)?)?)? for the optional copies
            optional_exits: list[int] = []
            for _ in range(hi - lo):
                split = self.state(_SPLIT)
                s, e = self.seq(sub)
                self.out[split].append(s)
                append((split, e))
                optional_exits.append(split)
            if optional_exits:
                exits = exits + optional_exits
        if start is None:
            s = self.state(_SPLIT)
            return s, [s]
        return start, exits


class Pattern:
    """One compiled key. ``matches(path)`` answers PEFT's question in bounded time."""

    def __init__(self, key: str):
        if not isinstance(key, str):
            raise PatternError(f"pattern keys are strings, got {type(key).__name__}")
        if len(key) > MAX_KEY_CHARS:
            raise PatternError(f"it is {len(key)} characters long (at most {MAX_KEY_CHARS})")
        try:
            parsed = _p.parse(key)
        except re.error as e:
            raise PatternError(f"it is not a valid regular expression ({e})") from None
        if parsed.state.flags & ~(re.UNICODE | getattr(_c, "SRE_FLAG_UNICODE", 0)):
            raise PatternError("inline flags such as (?i) are not supported")
        self.key = key
        # A key without repeats or alternation has a fixed length: Python's own matcher
        # tries it once after each dot, linear cost; the automaton is the general path.
        self._fast = (re.compile(rf"(?:.*\.)?(?:{key})$").match
                      if not _has_choice(list(parsed)) else None)
        b = _Builder()
        start, exits = b.seq(list(parsed))
        match = b.state(_MATCH)
        b.patch(exits, match)
        self._kind, self._data, self._out, self._start = b.kind, b.data, b.out, start

    @property
    def states(self) -> int:
        return len(self._kind)

    def _closure(self, seeds, pos: int, n: int, into: set) -> None:
        stack = list(seeds)
        kind, out = self._kind, self._out
        while stack:
            s = stack.pop()
            if s in into:
                continue
            into.add(s)
            k = kind[s]
            if k == _SPLIT:
                stack.extend(out[s])
            elif k == _BEGIN:
                if pos == 0:
                    stack.extend(out[s])
            elif k == _END:
                if pos == n:
                    stack.extend(out[s])

    def matches(self, path: str, budget: Budget | None = None) -> bool:
        """PEFT's rule: the key matches the whole path, or a suffix of it right after a dot."""
        if self._fast is not None:
            return self._fast(path) is not None
        n = len(path)
        kind, data, out = self._kind, self._data, self._out
        current: set = set()
        self._closure([self._start], 0, n, current)
        for i, ch in enumerate(path):
            seeds = [t for s in current if kind[s] == _CHAR and data[s](ch) for t in out[s]]
            if ch == ".":  # a new match may start after every dot
                seeds.append(self._start)
            current = set()
            if seeds:
                self._closure(seeds, i + 1, n, current)
                if budget is not None:
                    budget.spend(len(seeds) + len(current), self.key)
        return any(kind[s] == _MATCH for s in current)

    def __repr__(self) -> str:
        return f"Pattern({self.key!r})"


def _has_choice(items) -> bool:
    for op, av in items:
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, _c.BRANCH):
            return True
        if op is _c.SUBPATTERN and _has_choice(list(av[3])):
            return True
    return False


def first_match(patterns: list[tuple[Pattern, object]], path: str, budget: Budget | None = None):
    """The value of the first pattern (in order) that matches the path, or None. Raises
    `PatternError` (with ``.key``) when `budget` runs out."""
    for pat, value in patterns:
        try:
            if pat.matches(path, budget):
                return value
        except PatternError as e:
            e.key = pat.key
            raise
    return None
