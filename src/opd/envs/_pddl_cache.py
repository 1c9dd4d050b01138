"""Memoised parsing and lighter copies for ALFWorld's engine (textworld's PddlEnv): the same games, 4-35x faster.

Playing an ALFWorld game spends most of its time re-parsing text that never changes and deep-copying
what it never changes. Every load parses the game's logic (the domain's actions and grammar) with
tatsu, every reset translates the PDDL problem for fast-downward twice, every step re-parses each
admissible action's command template and each grammar rule's condition, and every symbol of every
text it derives (the feedback and each admissible command) deep-copies its context's entities.
``python benchmarks/bench_envs.py --caches 40`` (one thread, 40 level-1 games played twice with
random commands, 10 turns; benchmarks/results/engine_caches.json): 7.7 s a pass as textworld ships,
2.1 s with these patches on games never played before and 0.2 s on games played before (what a
training run mostly sees; 2.9 s and 1.1 s with the parse caches alone, measured beside them), with
identical observations, rewards and admissible commands (also a test in ``tests/envs/test_alfworld_textworld.py``).

What is cached are pure functions of their text arguments:

* ``textworld.envs.pddl.textgen._parse_and_convert`` (grammar text -> symbols): the caller
  mutates the symbols it gets (it sets their context), so each call gets a deep copy of the
  cached parse, which is ~100 times cheaper than parsing;
* ``textworld.logic.Rule.parse_conjunctive_query`` (a rule's condition -> Rule): Rules are
  immutable apart from their own memo, so the parse is shared;
* ``GameLogic(domain, grammar)`` as PddlEnv sees it: after construction it is only read (the
  PDDL state re-adds the domain's types to it, which changes nothing), so a game's logic is
  shared by every engine that plays it;
* ``fast_downward.pddl2sas`` as the PDDL state sees it (domain, problem -> task, SAS text): the
  task is only read.

The last two patch the names the engine's modules look up (``pddl_logic`` in
``textworld.envs.pddl.pddl``, ``fast_downward`` in ``textworld.envs.pddl.logic``); the modules
they name are untouched. Bounded: about 140 KB per game's logic and 130 KB per translated
problem of a generated game (two per game), so ~200 MB at most for the entries kept; grammar
fragments are few and small.

Not a cache: ``textgen.copy_context`` copies a context's two dicts instead of deep-copying the
entities they hold (see :func:`_copy_context`).
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any

LOGICS, TRANSLATIONS = 512, 1024  # games' logics and fast-downward translations (two per game) kept
_FRAGMENTS = 8192  # grammar fragments and rule conditions kept
_lock = threading.Lock()
_originals: dict[str, Any] = {}
_caches: list[Any] = []  # the memoised functions, while installed


class _Module:
    """A module as one caller sees it: ``overrides`` in place of some of its names."""

    def __init__(self, module: Any, **overrides: Any):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def install() -> None:
    """Put the caches in place (once per process; idempotent and thread-safe)."""
    with _lock:
        if _originals:
            return
        try:
            import textworld.envs.pddl.logic as pddl_logic
            import textworld.envs.pddl.pddl as pddl_env
            import textworld.envs.pddl.textgen as textgen
            from textworld.logic import Rule

            found = dict(
                textgen=textgen._parse_and_convert,
                copy_context=textgen.copy_context,
                rule_query=Rule.__dict__["parse_conjunctive_query"],
                fast_downward=pddl_logic.fast_downward,
                pddl_logic=pddl_env.pddl_logic,
            )
            pddl_logic.GameLogic, pddl_logic.fast_downward.pddl2sas  # noqa: B018 (present, or no caches)
        except (ImportError, AttributeError, KeyError):
            return  # a textworld whose internals moved: it plays as it ships (slower, the same games)
        _originals.update(found)
        parse = _originals["textgen"]
        parsed = functools.lru_cache(maxsize=_FRAGMENTS)(lambda text, rule: parse(text, rule_name=rule))

        def parse_and_convert(text: str, rule_name: str | None = None, **options: Any) -> Any:
            if options.get("trace") or set(options) - {"trace"}:  # tracing prints as it parses: not cached
                return parse(text, rule_name=rule_name, **options)
            return copy.deepcopy(parsed(text, rule_name))

        query = _originals["rule_query"].__func__
        queried = functools.lru_cache(maxsize=_FRAGMENTS)(lambda expr: query(Rule, expr))
        textgen._parse_and_convert = parse_and_convert
        textgen.copy_context = _copy_context
        Rule.parse_conjunctive_query = classmethod(lambda cls, expr: queried(expr) if cls is Rule else query(cls, expr))
        downward = _originals["fast_downward"]
        translate = lambda domain, problem, verbose=False, optimize=False: downward.pddl2sas(
            domain, problem, verbose=verbose, optimize=optimize
        )
        translated = functools.lru_cache(maxsize=TRANSLATIONS)(translate)
        logic = functools.lru_cache(maxsize=LOGICS)(pddl_logic.GameLogic)
        pddl_logic.fast_downward = _Module(downward, pddl2sas=translated)
        pddl_env.pddl_logic = _Module(pddl_logic, GameLogic=logic)
        _caches[:] = [parsed, queried, translated, logic]


def _copy_context(context: dict) -> dict:
    """textgen's copy of a derivation context, without deep-copying the entities in it: a derivation
    only rebinds a context's two dicts or ``update``s its own copies of them, and reads the entity
    infos and variables they hold, so copies of the dicts are the deep copy's equal at a fraction
    of its cost (deep copies were most of a game step's time)."""
    return {
        "state": context["state"],
        "facts": context["facts"],
        "variables": dict(context["variables"]),
        "mapping": dict(context["mapping"]),
        "entity_infos": context["entity_infos"],
    }


def clear() -> None:
    """Empty the caches (for measurements that start cold)."""
    with _lock:
        for cached in _caches:
            cached.cache_clear()


def uninstall() -> None:
    """Textworld as it ships (for tests that compare the two)."""
    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.pddl as pddl_env
    import textworld.envs.pddl.textgen as textgen
    from textworld.logic import Rule

    with _lock:
        if not _originals:
            return
        textgen._parse_and_convert = _originals.pop("textgen")
        textgen.copy_context = _originals.pop("copy_context")
        Rule.parse_conjunctive_query = _originals.pop("rule_query")
        pddl_logic.fast_downward = _originals.pop("fast_downward")
        pddl_env.pddl_logic = _originals.pop("pddl_logic")
        _caches.clear()
