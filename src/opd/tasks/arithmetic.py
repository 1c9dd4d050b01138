"""Synthetic arithmetic: the embedded default task (no network, no data files).

A problem is a left-to-right chain of 1..N operations (+, -, optionally *) on small non-negative
integers, in varied wording: expressions ("Compute 12 + 7 - 3."), spoken steps ("Start with 12,
then add 7, then take away 3."), and word problems (15 story frames, 300 names, 143 objects, 48
adjectives), so that a BPE tokenizer trained on the prompts learns a real vocabulary (>1000 used
tokens), not just digits. The solution has one fixed form, one equation per operation::

    <think>12 + 7 = 19. 19 - 3 = 16.</think> The answer is \\boxed{16}

Usage: ``task = ArithmeticTask.from_level(2)`` (or ``ArithmeticTask(num_ops=(1, 3), ...)``),
``ex = task.examples("train")[0]``, ``task.reward(ex.solution, ex) == 1.0``.

Every intermediate value stays in [0, 10000). Generation is seeded and deterministic; the test
split is drawn first and no train prompt repeats a test prompt's text.
"""

from __future__ import annotations

import random
import re
from collections import namedtuple

from opd.errors import UserError
from opd.tasks.grading import check_answer_format, grade
from opd.tasks.task import Example, check_split, reference_of

__all__ = ["ArithmeticTask", "LEVELS", "MAX_ANSWER", "SOLUTION_STYLES", "reformat_solution", "solve_chain"]

MAX_ANSWER = 10_000  # exclusive bound on every intermediate and final value
MAX_MULTIPLIER = 9  # single-digit factors keep * learnable for tiny models
OPS = ("+", "-", "*")

# level -> (num_ops range, max_operand). Level 2 is the demo's: tiny models learn to parse the
# stories quickly, and operands up to 20 keep the arithmetic learnable in minutes on a CPU.
LEVELS = {1: ((1, 1), 9), 2: ((1, 2), 20), 3: ((1, 2), 99), 4: ((2, 3), 99), 5: ((3, 4), 999)}

_SHE = """Mia Emma Olivia Ava Sophia Isabella Amelia Harper Evelyn Abigail Ella Chloe Grace Lily
Zoe Nora Hannah Layla Aria Riley Stella Lucy Ruby Alice Clara Maya Sara Nina Julia Elena Rosa
Fatima Aisha Priya Mei Yuki Hana Leila Ingrid Freya Astrid Chiara Lucia Camila Valentina Daniela
Gabriela Ana Marta Irene Olga Tanya Keiko Sakura Amara Zara Nadia Eva Greta Heidi Paula Diana Helen
Laura Emily Rachel Naomi Beth Molly Daisy Iris Violet Hazel Jade Luna Willow Audrey Bella Brooke
Cora Delia Eliza Fiona Gemma Ivy Josie Kira Lena Mabel Nell Opal Piper Rhea Sadie Tessa Uma Vera
Wendy Yara Zelda Adele Bianca Carmen Dora Esme Flora Gloria Hilda Jana Lorena Maria Noor Odette
Petra Rania Selma Talia Ursula Vivian Wanda Yasmin Zainab Agnes Beatrice Cecilia Dahlia Edith Frida
Gwen Harriet Imogen Katya Marisol Nadine Orla Pilar Sienna Valeria Winona Ximena Yolanda Zuri Ngozi
Adaeze Mariam Soraya Anika Deepa Meera Sunita""".split()
_HE = """Liam Noah Oliver Elijah James William Benjamin Lucas Henry Leo Jack Owen Samuel Daniel
Matthew Jacob Ethan Mason Logan Caleb Ryan Nathan Aaron Isaac Adam Omar Ali Hassan Ravi Arjun Kenji
Hiro Wei Chen Tomas Mateo Diego Carlos Pablo Marco Luca Felix Hugo Oscar Anton Ivan Dmitri Lars
Sven Erik Finn Kofi Kwame Tariq Yusuf Amir Sami Rafael Bruno Andre Victor Simon Peter Paul George
Arthur Frank Walter Harry Charlie Max Theo Jonah Miles Ezra Felipe Aiden Blake Cyrus Dario Emil
Fabian Gideon Harvey Ignacio Jasper Kai Levi Magnus Nico Otis Quentin Rocco Silas Tobias Umar
Vikram Wyatt Xavier Yosef Zane Ahmed Bilal Cedric Dominic Elias Farid Gustav Hamza Idris Jamal
Karim Lorenzo Malik Nikolai Pedro Rohan Stefan Ulrich Wolfgang Yannick Zoran Abel Boris Clement
Desmond Edgar Florian Gregor Horace Ishaan Jomo Leandro Milos Nasser Obi Chidi Emeka Tunde Sanjay
Vijay Rahul Deepak Jun Takeshi Ryo Minho Joon Bao Joaquin""".split()
# Optional adjective before an object ("striped marbles"): more words for the tokenizer to learn.
_ADJ = """red blue green yellow purple orange pink white black brown gray golden silver shiny tiny
small large big little huge old new rare fancy plain striped spotted colorful bright lovely cheap
expensive favorite extra special lucky beautiful strange odd ordinary pretty nice perfect unusual
common clean dirty funny""".split()


def _p(s: str) -> tuple[str, ...]:
    """A '|'-separated list of phrases (lines may wrap)."""
    return tuple(" ".join(p.split()) for p in s.split("|"))


# Fillers for the {field}s of story sentences. "when" is mostly empty, else appended to a sentence.
_POOLS = {
    "when": ("",) * 6
    + tuple(
        " " + w
        for w in _p(
            "later|the next day|in the afternoon|after lunch|that evening|on Monday|on Friday|"
            "over the weekend|the following week|an hour later|before dinner|during recess"
        )
    ),
    "city": tuple(
        """Paris Lisbon Madrid Berlin Vienna Prague Warsaw Oslo Dublin London Boston
        Denver Chicago Seattle Toronto Sydney Lagos Nairobi Cairo Mumbai Delhi Tokyo Osaka Seoul
        Lima Bogota Havana Athens Rome Amsterdam Brussels Zurich Geneva Milan Naples Venice
        Florence Munich Hamburg Stockholm Helsinki Copenhagen Reykjavik Edinburgh Glasgow
        Manchester Liverpool Bristol Montreal Vancouver Calgary Houston Dallas Austin Phoenix Miami
        Atlanta Portland Detroit Nashville Accra Dakar Casablanca Tunis Istanbul Karachi Dhaka
        Bangkok Hanoi Manila Jakarta Singapore Beijing Shanghai Taipei Melbourne""".split()
    ),
    "day": tuple("Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()),
    "season": ("spring", "summer", "autumn", "winter"),
    "meal": _p("breakfast|lunch|dinner|noon"),
    "container": _p("shoebox|jar|drawer|tin|backpack|wooden chest|basket|cardboard box|suitcase"),
    "found": _p(
        "under the sofa|in the attic|at the park|on the beach|in the garage|behind the "
        "bookcase|in a puddle|near the river|under a bench|in the cellar|by the fountain"
    ),
    "lost": _p("on the bus|at school|during a trip|in the snow|at the playground|in the forest"),
    "market": _p("flea market|school fair|garage sale|street market|swap meet|craft fair"),
    "charity": _p("school library|children's hospital|community center|local shelter|museum"),
    "wallet": _p("wallet|piggy bank|savings account|purse|money box|secret envelope"),
    "job": _p(
        "walking dogs|mowing lawns|washing cars|babysitting|tutoring math|selling lemonade|"
        "delivering newspapers|painting fences|raking leaves|shoveling snow|fixing "
        "bicycles|watering plants|cleaning windows|feeding cats|teaching piano"
    ),
    "purchase": _p(
        "a new backpack|concert tickets|a video game|art supplies|a birthday present|"
        "groceries|a pair of sneakers|movie tickets|a bicycle helmet|school books|"
        "a guitar string|a warm scarf|a skateboard|a telescope|sunglasses|an umbrella"
    ),
    "relative": _p("grandmother|grandfather|aunt|uncle|cousin|older sister|older brother"),
    "clothing": _p("jacket|coat pocket|pair of jeans|raincoat|sweater|hoodie|handbag"),
    "vehicle": _p("bus|train|ferry|tram|subway|shuttle|cable car|minibus"),
    "stop": _p("first|second|third|central|museum|airport|harbor|market|stadium|hospital"),
    "adj": _p("town|city|school|village|university|public|old|new|neighborhood"),
    "event": _p(
        "party|picnic|bake sale|school fair|birthday|wedding|festival|holiday dinner|family reunion|graduation|carnival"
    ),
    "goods": _p(
        "rice|shoes|toys|paper|tea|coffee|tools|soap|glass|fabric|candles|flour|sugar|"
        "batteries|blankets|lamps|spices|yarn"
    ),
    "game": _p(
        "chess|basketball|a quiz|a video game|darts|bowling|trivia night|a spelling bee|"
        "table tennis|a board game|mini golf|volleyball|a crossword contest|badminton"
    ),
    "trail": _p("river path|forest trail|beach|mountain road|canal|park loop|hiking trail|lakeshore|desert track"),
    "gear": _p("hat|water bottle|map|glove|compass|camera|flashlight|scarf"),
    "liquid": _p("water|juice|milk|lemonade|soup|tea|syrup|olive oil"),
    "vessel": _p("barrel|pot|cooler|bathtub|fountain|big bowl|jug|kettle"),
    "use": _p("cooking|cleaning|a science project|the plants|washing dishes|a recipe"),
    "group": _p("club|class|team|choir|orchestra|summer camp|scout troop|book club|dance class"),
    "venue": _p(
        "museum|stadium|concert hall|zoo|park|beach|theater|gym|mall|airport|hospital|"
        "train station|library|aquarium|bakery|cinema|harbor|market square"
    ),
    "dish": _p("jam|a pie|juice|a fruit salad|smoothies|a cake|a crumble|sorbet"),
    "weather": _p("heat wave|storm|frost|dry spell|heavy rain|hailstorm"),
}
_POOLS["city2"] = _POOLS["city"]


# One story setting: its objects, then sentence templates for the opening, "+", "-" and the
# question; any {field} of _POOLS may appear. adj: objects may take an adjective from _ADJ.
_Frame = namedtuple("_Frame", "items start add sub ask adj")


def _f(items: str, start: str, add: str, sub: str, ask: str, adj: bool = True) -> _Frame:
    words = tuple(i.replace("_", " ") for i in items.split())
    return _Frame(words, _p(start), _p(add), _p(sub), _p(ask), adj)


_FRAMES = (
    _f(
        "marbles stickers pencils seashells stamps crayons beads buttons trading_cards postcards "
        "keychains bookmarks badges magnets figurines toy_cars comic_books puzzles kites feathers "
        "pebbles acorns ribbons bracelets erasers notebooks markers paintbrushes dice dominoes",
        "{name} has {n} {item}.|{name} owns a collection of {n} {item}.|"
        "{name} keeps {n} {item} in a {container}.|At first, {name} has {n} {item}.",
        "{He} buys {n} more{when}.|{other} gives {him} {n} more {item}{when}.|{He} finds {n} {item} "
        "{found}.|{He} wins {n} {item} in a contest{when}.|{He} gets {n} {item} for {his} birthday.",
        "{He} gives {n} to {other}{when}.|{He} loses {n} of them {lost}.|{He} trades {n} {item} "
        "with {other}.|{He} sells {n} {item} at the {market}.|{He} donates {n} {item} to the "
        "{charity}.",
        "How many {item} does {name} have now?|How many {item} does {name} end up with?|"
        "How many {item} are left in {name}'s collection?",
    ),
    _f(
        "dollars euros pounds coins tokens credits",
        "{name} has {n} {item} in {his} {wallet}.|{name} saved {n} {item} last month.",
        "{He} earns {n} {item} {job}{when}.|{His} {relative} sends {him} {n} {item}.|"
        "{He} finds {n} {item} in an old {clothing}.",
        "{He} spends {n} {item} on {purchase}.|{He} pays {n} {item} for {purchase}{when}.|"
        "{He} lends {n} {item} to {other}.",
        "How many {item} does {name} have left?|How much money, in {item}, does {name} have now?",
        adj=False,
    ),
    _f(
        "passengers travelers people commuters tourists",
        "A {vehicle} leaves {city} with {n} {item}.|There are {n} {item} on the {vehicle}.",
        "At the {stop} stop, {n} {item} get on.|{n} more {item} board the {vehicle} in {city2}.",
        "At the next station, {n} {item} get off.|{n} {item} leave the {vehicle} in {city2}.",
        "How many {item} are on the {vehicle} now?|How many {item} remain on board?",
        adj=False,
    ),
    _f(
        "novels mystery_books cookbooks dictionaries atlases biographies poetry_books "
        "picture_books history_books science_books magazines",
        "The {adj} library has {n} {item} on one shelf.|{name} arranges {n} {item} on a bookshelf.",
        "The librarian adds {n} new {item}{when}.|A donor brings in {n} {item}.",
        "Readers borrow {n} {item}{when}.|{n} {item} are sent away for repair.",
        "How many {item} are on the shelf now?|How many {item} does the shelf hold at the end?",
    ),
    _f(
        "cows sheep goats chickens ducks pigs horses rabbits geese turkeys llamas donkeys alpacas",
        "Farmer {name} keeps {n} {item} on {his} farm.|{name}'s farm near {city} has {n} {item}.",
        "{He} buys {n} more {item} at the market.|{n} young {item} are born in {season}.",
        "{He} sells {n} {item} to a neighbor.|{n} {item} wander off through a broken fence.",
        "How many {item} are on the farm now?|How many {item} does {name} have in the end?",
    ),
    _f(
        "cookies muffins cupcakes brownies pancakes rolls pies tarts bagels croissants donuts scones waffles dumplings",
        "{name} bakes {n} {item} for the {event}.|{name} has {n} {item} on a tray.",
        "{He} bakes another {n} {item}{when}.|{other} brings {n} more {item}.",
        "{His} friends eat {n} {item}.|{He} packs {n} {item} for {other}.|{n} {item} get burned and are thrown away.",
        "How many {item} are left?|How many {item} does {name} have for the {event}?",
    ),
    _f(
        "tulips roses sunflowers daisies tomato_plants carrots lilies orchids cacti pepper_plants bushes saplings",
        "There are {n} {item} in {name}'s garden.|{name} grows {n} {item} in {his} backyard.",
        "{He} plants {n} more {item} in {season}.|{other} gives {him} {n} {item} to plant.",
        "{n} {item} wilt during the {weather}.|{He} gives {n} {item} to {other}.",
        "How many {item} are in the garden now?|How many {item} does {name} have growing now?",
    ),
    _f(
        "boxes crates pallets packages barrels containers sacks cartons",
        "A warehouse in {city} stores {n} {item} of {goods}.|The {goods} factory has {n} {item}.",
        "A truck delivers {n} more {item}{when}.|The workers pack {n} new {item}.",
        "{n} {item} are shipped to {city2}.|A customer orders {n} {item}.",
        "How many {item} are in stock now?|How many {item} of {goods} are there now?",
    ),
    _f(
        "points stars gems tickets",
        "{name} scores {n} {item} in round one of {game}.|{name} starts {game} with {n} {item}.",
        "{He} earns {n} more {item} in the next round.|A bonus question gives {him} {n} {item}.",
        "{He} loses {n} {item} for a penalty.|{n} {item} are taken away for a foul.",
        "What is {name}'s score now, in {item}?|How many {item} does {name} have at the end?",
        adj=False,
    ),
    _f(
        "kilometers miles meters blocks laps",
        "{name} walks {n} {item} along the {trail}.|{name} runs {n} {item} on {day} morning.",
        "{He} goes on for {n} more {item}.|{He} adds {n} {item} after a short rest.",
        "{He} turns back {n} {item} to look for {his} lost {gear}.",
        "How far from the start is {name} now, in {item}?|How many {item} from the start is {name}?",
        adj=False,
    ),
    _f(
        "liters gallons cups buckets bottles",
        "A tank holds {n} {item} of {liquid}.|A {vessel} contains {n} {item} of {liquid}.",
        "{name} pours in {n} more {item}.|{name} refills it with {n} {item}{when}.",
        "{n} {item} leak out{when}.|{name} pours out {n} {item}.|{n} {item} are used for {use}.",
        "How many {item} of {liquid} are there now?|How much {liquid} is left, in {item}?",
        adj=False,
    ),
    _f(
        "students children guests visitors members players volunteers",
        "A {group} has {n} {item}.|There are {n} {item} at the {venue}.",
        "{n} more {item} arrive{when}.|{n} new {item} join them.",
        "{n} {item} go home early.|{n} {item} leave to catch a {vehicle}.",
        "How many {item} are there now?|How many {item} are left in the end?",
        adj=False,
    ),
    _f(
        "cars vans trucks bikes motorcycles scooters",
        "A parking lot at the {venue} holds {n} {item}.|There are {n} {item} parked by the {venue}.",
        "{n} more {item} pull in{when}.|Another {n} {item} arrive from {city}.",
        "{n} {item} drive away.|{n} {item} leave before {meal}.",
        "How many {item} are in the lot now?|How many {item} are still parked?",
    ),
    _f(
        "goldfish guppies snails tetras angelfish shrimp clownfish",
        "{name}'s aquarium has {n} {item}.|{name} keeps {n} {item} in a fish tank.",
        "{He} buys {n} more at the pet store.|{other} gives {him} {n} {item}.",
        "{He} gives {n} {item} to {other}.|{He} moves {n} {item} to a pond.",
        "How many {item} are in the aquarium now?|How many {item} does {name} have now?",
    ),
    _f(
        "apples pears plums cherries peaches oranges lemons apricots figs mangoes",
        "{name} picks {n} {item} at the orchard.|{name} has a basket with {n} {item}.",
        "{He} picks {n} more before {meal}.|{other} adds {n} {item} to the basket.",
        "{He} uses {n} {item} to make {dish}.|{He} shares {n} {item} with {other}.",
        "How many {item} are in the basket now?|How many {item} does {name} have left?",
    ),
)

_MUL_SENTENCES = _p(
    "Then the number of {item} becomes {n} times as large.|After that, the amount "
    "is multiplied by {n}.|Then the total grows to {n} times what it was."
)

_PLAIN = (
    "Compute {e}.",
    "What is {e}?",
    "Calculate {e}.",
    "Evaluate {e}.",
    "Find the value of {e}.",
    "Work out {e}.",
    "Solve: {e} = ?",
    "{e} = ?",
    "What does {e} equal?",
    "Determine the result of {e}.",
    "Please compute {e}.",
    "Quick question: what is {e}?",
    "Give the value of {e}.",
    "What number is {e}?",
    "Simplify {e}.",
    "Tell me the result of {e}.",
)
_STEP_WORDS = {
    "+": ("add {b}", "increase it by {b}", "add {b} to it", "put {b} more on top"),
    "-": ("subtract {b}", "take away {b}", "decrease it by {b}", "remove {b}"),
    "*": ("multiply it by {b}", "make it {b} times bigger"),
}
_PASSIVE = {"+": "increased by", "-": "decreased by", "*": "multiplied by"}
_INFIX = {"+": "plus", "-": "minus", "*": "times"}
_STEPS = (
    "Start with {a}, then {steps}. What number do you get?",
    "Begin with the number {a}, then {steps}. What is the result?",
    "I think of the number {a}. I {steps}. Which number do I have now?",
    "Take {a}, {steps}. What do you end up with?",
)


def solve_chain(a: int, steps: list[tuple[str, int]]) -> tuple[int, str]:
    """Evaluate ``a op1 b1 op2 b2 ...`` left to right; return (answer, fixed-format solution)."""
    value, eqs = a, []
    for op, b in steps:
        new = value + b if op == "+" else value - b if op == "-" else value * b
        eqs.append(f"{value} {op} {b} = {new}.")
        value = new
    return value, f"<think>{' '.join(eqs)}</think> The answer is \\boxed{{{value}}}"


def _sample_chain(rng: random.Random, n_ops: int, max_operand: int, ops: tuple[str, ...]):
    value = rng.randint(1, max_operand)
    a, steps = value, []
    for _ in range(n_ops):
        feasible = [
            o
            for o in ops
            if (o == "+" and value + 1 < MAX_ANSWER)
            or (o == "-" and value >= 1)
            or (o == "*" and 1 <= value and value * 2 < MAX_ANSWER and max_operand >= 2)
        ]
        op = rng.choice(feasible or ["-"])
        if op == "+":
            b = rng.randint(1, min(max_operand, MAX_ANSWER - 1 - value))
        elif op == "-":
            b = rng.randint(1, min(max_operand, value))  # never below zero
        else:
            b = rng.randint(2, min(MAX_MULTIPLIER, max_operand, (MAX_ANSWER - 1) // value))
        value = value + b if op == "+" else value - b if op == "-" else value * b
        steps.append((op, b))
    return a, steps


def _expression(a: int, steps: list[tuple[str, int]]) -> str:
    expr = str(a)
    for op, b in steps:
        # Parentheses keep the conventional reading equal to the left-to-right chain.
        if op == "*" and ("+" in expr or "-" in expr):
            expr = f"({expr})"
        expr = f"{expr} {op} {b}"
    return expr


class _Fields(dict):
    """Fills story {fields} on first use and keeps them, so a story names one city, one item."""

    def __init__(self, rng: random.Random, **fixed):
        super().__init__(fixed)
        self.rng = rng

    def __missing__(self, key: str) -> str:
        value = self.rng.choice(_POOLS[key])
        if key != "when":  # "when" varies per sentence
            self[key] = value
        return value


def _story(rng: random.Random, a: int, steps: list[tuple[str, int]]) -> str:
    frame = rng.choice(_FRAMES)
    she = rng.random() < 0.5
    name = rng.choice(_SHE if she else _HE)
    other = rng.choice([x for x in rng.choice((_SHE, _HE)) if x != name])
    he, his, him = ("she", "her", "her") if she else ("he", "his", "him")
    item = rng.choice(frame.items)
    if frame.adj and rng.random() < 0.4:
        item = f"{rng.choice(_ADJ)} {item}"
    fields = _Fields(
        rng, name=name, other=other, item=item, he=he, He=he.capitalize(), his=his, His=his.capitalize(), him=him
    )
    fields["n"] = a
    parts = [rng.choice(frame.start).format_map(fields)]
    used: set[str] = set()
    for op, b in steps:
        pool = {"+": frame.add, "-": frame.sub, "*": _MUL_SENTENCES}[op]
        # A fresh sentence if possible: "He buys 3 more. He buys 5 more." reads badly.
        fresh = [s for s in pool if s not in used] or list(pool)
        sentence = rng.choice(fresh)
        used.add(sentence)
        fields["n"] = b
        parts.append(sentence.format_map(fields))
    parts.append(rng.choice(frame.ask).format_map(fields))
    return " ".join(parts)


def _spoken(rng: random.Random, a: int, steps: list[tuple[str, int]]) -> str:
    kind = rng.randrange(3)
    if kind == 0 and all(op != "*" for op, _ in steps):
        words = " ".join(f"{_INFIX[op]} {b}" for op, b in steps)
        return rng.choice(("What is {a} {w}?", "How much is {a} {w}?")).format(a=a, w=words)
    if kind == 1:
        done = ", then ".join(f"{_PASSIVE[op]} {b}" for op, b in steps)
        return f"A counter starts at {a}. It is {done}. What does the counter show?"
    said = ", then ".join(rng.choice(_STEP_WORDS[op]).format(b=b) for op, b in steps)
    return rng.choice(_STEPS).format(a=a, steps=said)


def _prompt(rng: random.Random, a: int, steps: list[tuple[str, int]]) -> str:
    r = rng.random()
    if r < 0.35:
        return rng.choice(_PLAIN).format(e=_expression(a, steps))
    if r < 0.5:
        return _spoken(rng, a, steps)
    return _story(rng, a, steps)


class ArithmeticTask:
    """Left-to-right integer arithmetic with varied wording; see the module docstring."""

    def __init__(
        self,
        num_ops: tuple[int, int] | int = (1, 2),
        max_operand: int = 99,
        n_train: int = 20000,
        n_test: int = 500,
        seed: int = 0,
        ops: tuple[str, ...] = ("+", "-"),
        name: str = "arithmetic",
        answer_format: str = "boxed",
        system_prompt: str = "",
    ):
        check_answer_format(answer_format)
        lo, hi = (num_ops, num_ops) if isinstance(num_ops, int) else tuple(num_ops)
        if not 1 <= lo <= hi:
            raise UserError(f"num_ops must satisfy 1 <= min <= max, got {num_ops!r}")
        if not 1 <= max_operand < MAX_ANSWER:
            raise UserError(f"max_operand must be in [1, {MAX_ANSWER - 1}], got {max_operand}")
        if n_train < 0 or n_test < 0:
            raise UserError(f"n_train and n_test must be >= 0, got {n_train} and {n_test}")
        if not ops or any(o not in OPS for o in ops):
            raise UserError(f"ops must be a non-empty subset of {OPS}, got {ops!r}")
        self.name, self.num_ops, self.max_operand = name, (lo, hi), max_operand
        self.n_train, self.n_test, self.seed, self.ops = n_train, n_test, seed, tuple(ops)
        self.answer_format, self.system_prompt = answer_format, system_prompt
        self._splits: dict[str, list[Example]] | None = None

    @classmethod
    def from_level(cls, level: int, **kwargs) -> ArithmeticTask:
        """Preset difficulty: 1 = one op on 1..9, 2 = 1-2 ops on 1..20 (the default), 3 = 1-2 ops
        on 1..99, 4 = 2-3 ops on 1..99, 5 = 3-4 ops on 1..999. Other kwargs pass through."""
        if level not in LEVELS:
            raise UserError(f"unknown arithmetic level {level!r}: use one of {sorted(LEVELS)}")
        num_ops, max_operand = LEVELS[level]
        return cls(num_ops=num_ops, max_operand=max_operand, **kwargs)

    def examples(self, split: str) -> list[Example]:
        check_split(split)
        if self._splits is None:
            test = self._generate("test", self.n_test, exclude=set())
            train = self._generate("train", self.n_train, exclude={e.prompt for e in test})
            self._splits = {"train": train, "test": test}
        return list(self._splits[split])

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if grade(completion, reference_of(example), self.answer_format) else 0.0

    def _generate(self, split: str, n: int, exclude: set[str]) -> list[Example]:
        # A string seed is hashed with SHA-512 by `random`: stable across runs and machines.
        rng = random.Random(f"opd-arithmetic/{self.seed}/{split}")
        seen = set(exclude)
        out: list[Example] = []
        for _ in range(50 * n + 1000):
            if len(out) == n:
                return out
            a, steps = _sample_chain(rng, rng.randint(*self.num_ops), self.max_operand, self.ops)
            prompt = _prompt(rng, a, steps)
            if prompt in seen:
                continue
            seen.add(prompt)
            answer, solution = solve_chain(a, steps)
            out.append(Example(prompt, str(answer), self.name, solution, self.system_prompt or None))
        raise UserError(
            f"could only make {len(out)} distinct {split} prompts of {n} requested: "
            "lower n_train/n_test or raise max_operand/num_ops"
        )


# ----------------------------------------------------------------------------- other solution formats
# For experiments on thinking-pattern mismatch (opd experiment teacher-choice): the same
# arithmetic written in another chain-of-thought format. The default format above is unchanged.

_EQUATION = re.compile(r"(\d+) ([+\-*]) (\d+) = (\d+)\.")
_WORDS = {"+": "plus", "-": "minus", "*": "times"}
SOLUTION_STYLES = ("default", "words")


def reformat_solution(solution: str, style: str) -> str:
    """Rewrite a default-format solution in another style.

    ``words``: no ``<think>`` block, one sentence per step in words, e.g. ``Step 1: 12 plus 7
    makes 19. Step 2: 19 minus 3 makes 16. So the answer is \\boxed{16}``."""
    if style not in SOLUTION_STYLES:
        raise UserError(f"unknown solution style {style!r}; choose one of {', '.join(SOLUTION_STYLES)}")
    if style == "default":
        return solution
    eqs = _EQUATION.findall(solution)
    answer = re.search(r"\\boxed\{([^}]*)\}", solution)
    if not eqs or answer is None:
        raise UserError(f"not a default-format arithmetic solution: {solution[:60]!r}")
    steps = " ".join(f"Step {i}: {a} {_WORDS[op]} {b} makes {c}." for i, (a, op, b, c) in enumerate(eqs, 1))
    return f"{steps} So the answer is \\boxed{{{answer.group(1)}}}"
