"""Per-domain surface forms for the procedural isomer generator.

Each domain renders the same abstract DAG (see ``iga_ds.data.dag``) with its own nouns,
adjectives and sentence frames, so that the instances of a group differ only in surface
form (the paper's "Logical Isomer Sets", section 3.3). Words are lower case and every token
is separated by spaces, punctuation included, so a word-level tokenizer needs no rules.

The frames are plain ``str.format`` templates. Tests rebuild the logical structure from the
rendered text with these same frames, which is how exact isomorphism is checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from iga_ds.errors import UserError

DEFAULT_DOMAINS = ("math", "medical", "legal", "science")

# Paper, section 3.3: the four semantic domains; the descriptions go into the teacher's
# domain-instantiation prompt.
DOMAIN_DESCRIPTIONS = {
    "math": "Mathematics: algebra, number theory, combinatorics, geometry.",
    "medical": "Medicine: diagnosis, pharmacology, case studies, epidemiology.",
    "legal": "Law: contract interpretation, statutory reasoning, case law, procedural analysis.",
    "science": "Science: physics, chemistry, biological inference, experimental design.",
}


@dataclass(frozen=True)
class Domain:
    """Vocabulary and sentence frames of one domain."""

    name: str
    # rule chains and conjunctions: one subject, adjectives as properties
    subject: str
    properties: tuple[str, ...]
    fact: str  # {s} {a}
    rule: str  # {s} {a} {b}
    conj_rule: str  # {s} {a} {b} {c}
    prop_question: str  # {s} {q}
    prop_step: str  # {s} {a} {b}
    conj_step: str  # {s} {a} {b} {c}
    # syllogisms: one individual, class nouns (consonant-initial, so "a" is right)
    individual: str
    classes: tuple[str, ...]
    member_fact: str  # {z} {A}
    isa_rule: str  # {A} {B}
    disjoint_rule: str  # {A} {B}
    class_question: str  # {z} {B}
    isa_step: str  # {z} {A} {B}
    disjoint_step: str  # {z} {A} {B}
    # arithmetic chains: named quantities, small integers
    quantities: tuple[str, ...]
    given: str  # {x} {v}
    add: str  # {y} {x} {k}
    sub: str  # {y} {x} {k}
    mul: str  # {y} {x} {k}
    num_question: str  # {y}
    add_step: str  # {y} {vx} {k} {v}
    sub_step: str  # {y} {vx} {k} {v}
    mul_step: str  # {y} {vx} {k} {v}
    # planted shortcut: a sentence with one slot; boolean answers map to two domain words,
    # integer answers fill the slot with the number itself
    cue: str  # {c}
    cue_words: dict[str, str] = field(default_factory=dict)

    def cue_sentence(self, signalled: str) -> str:
        """The cue sentence whose slot word signals the answer ``signalled``."""
        return self.cue.format(c=self.cue_words.get(signalled, signalled))

    def conclusion(self, kind: str, status: str, **slots: str) -> str:
        """Closing CoT line: the goal proven, refuted, or not derivable (closed world)."""
        if kind == "class":
            z, b = slots["z"], slots["b"]
            return {
                "proven": f"{z} is a {b}",
                "refuted": f"{z} is not a {b}",
                "unknown": f"nothing shows that {z} is a {b}",
            }[status]
        s, q = slots["s"], slots["q"]
        return {
            "proven": f"{s} is {q}",
            "refuted": f"{s} is not {q}",
            "unknown": f"nothing shows that {s} is {q}",
        }[status]


DOMAINS: dict[str, Domain] = {
    "math": Domain(
        name="math",
        subject="x",
        properties=("bounded", "finite", "positive", "rational", "prime", "square",
                    "convex", "linear", "periodic", "monic", "smooth", "dense"),
        fact="{s} is {a}",
        rule="if {s} is {a} then {s} is {b}",
        conj_rule="if {s} is {a} and {b} then {s} is {c}",
        prop_question="is {s} {q} ?",
        prop_step="{s} is {a} , so {s} is {b}",
        conj_step="{s} is {a} and {b} , so {s} is {c}",
        individual="the object z",
        classes=("group", "ring", "field", "lattice", "module", "graph", "tree",
                 "matrix", "vector", "polygon"),
        member_fact="{z} is a {A}",
        isa_rule="every {A} is a {B}",
        disjoint_rule="no {A} is a {B}",
        class_question="is {z} a {B} ?",
        isa_step="{z} is a {A} , so it is a {B}",
        disjoint_step="{z} is a {A} , so it is not a {B}",
        quantities=("a", "b", "c", "d", "e", "f", "g", "h"),
        given="{x} equals {v}",
        add="{y} equals {x} plus {k}",
        sub="{y} equals {x} minus {k}",
        mul="{y} equals {x} times {k}",
        num_question="what is {y} ?",
        add_step="{y} is {vx} plus {k} , so {y} equals {v}",
        sub_step="{y} is {vx} minus {k} , so {y} equals {v}",
        mul_step="{y} is {vx} times {k} , so {y} equals {v}",
        cue="this exercise is from chapter {c} .",
        cue_words={"yes": "alpha", "no": "omega"},
    ),
    "medical": Domain(
        name="medical",
        subject="the patient",
        properties=("feverish", "anemic", "dizzy", "septic", "hypoxic", "nauseous",
                    "jaundiced", "tachycardic", "dehydrated", "hypotensive", "infected", "lethargic"),
        fact="{s} is {a}",
        rule="every {a} patient is {b}",
        conj_rule="every {a} and {b} patient is {c}",
        prop_question="is {s} {q} ?",
        prop_step="{s} is {a} , so {s} is {b}",
        conj_step="{s} is {a} and {b} , so {s} is {c}",
        individual="the agent k",
        classes=("virus", "bacterium", "pathogen", "toxin", "hormone", "peptide",
                 "steroid", "microbe", "fungus", "parasite"),
        member_fact="{z} is a {A}",
        isa_rule="every {A} is a {B}",
        disjoint_rule="no {A} is a {B}",
        class_question="is {z} a {B} ?",
        isa_step="{z} is a {A} , so it is a {B}",
        disjoint_step="{z} is a {A} , so it is not a {B}",
        quantities=("ward a", "ward b", "ward c", "ward d", "ward e", "ward f", "ward g", "ward h"),
        given="{x} has {v} patients",
        add="{y} has {k} more patients than {x}",
        sub="{y} has {k} fewer patients than {x}",
        mul="{y} has {k} times as many patients as {x}",
        num_question="how many patients does {y} have ?",
        add_step="{y} has {vx} plus {k} , so {v} patients",
        sub_step="{y} has {vx} minus {k} , so {v} patients",
        mul_step="{y} has {vx} times {k} , so {v} patients",
        cue="the case was seen in clinic {c} .",
        cue_words={"yes": "north", "no": "south"},
    ),
    "legal": Domain(
        name="legal",
        subject="the contract",
        properties=("signed", "void", "binding", "valid", "enforceable", "breached",
                    "sealed", "notarized", "expired", "assigned", "disputed", "registered"),
        fact="{s} is {a}",
        rule="every {a} contract is {b}",
        conj_rule="every {a} and {b} contract is {c}",
        prop_question="is {s} {q} ?",
        prop_step="{s} is {a} , so {s} is {b}",
        conj_step="{s} is {a} and {b} , so {s} is {c}",
        individual="the filing q",
        classes=("tort", "felony", "misdemeanor", "statute", "claim", "lien",
                 "lease", "deed", "warrant", "motion"),
        member_fact="{z} is a {A}",
        isa_rule="every {A} is a {B}",
        disjoint_rule="no {A} is a {B}",
        class_question="is {z} a {B} ?",
        isa_step="{z} is a {A} , so it is a {B}",
        disjoint_step="{z} is a {A} , so it is not a {B}",
        quantities=("court a", "court b", "court c", "court d", "court e", "court f",
                    "court g", "court h"),
        given="{x} hears {v} cases",
        add="{y} hears {k} more cases than {x}",
        sub="{y} hears {k} fewer cases than {x}",
        mul="{y} hears {k} times as many cases as {x}",
        num_question="how many cases does {y} hear ?",
        add_step="{y} hears {vx} plus {k} , so {v} cases",
        sub_step="{y} hears {vx} minus {k} , so {v} cases",
        mul_step="{y} hears {vx} times {k} , so {v} cases",
        cue="the matter is filed under docket {c} .",
        cue_words={"yes": "amber", "no": "violet"},
    ),
    "science": Domain(
        name="science",
        subject="the sample",
        properties=("heated", "ionized", "acidic", "magnetic", "charged", "frozen",
                    "oxidized", "radioactive", "soluble", "volatile", "opaque", "brittle"),
        fact="{s} is {a}",
        rule="every {a} sample is {b}",
        conj_rule="every {a} and {b} sample is {c}",
        prop_question="is {s} {q} ?",
        prop_step="{s} is {a} , so {s} is {b}",
        conj_step="{s} is {a} and {b} , so {s} is {c}",
        individual="the specimen w",
        classes=("metal", "gas", "crystal", "polymer", "mineral", "salt",
                 "colloid", "solvent", "catalyst", "lipid"),
        member_fact="{z} is a {A}",
        isa_rule="every {A} is a {B}",
        disjoint_rule="no {A} is a {B}",
        class_question="is {z} a {B} ?",
        isa_step="{z} is a {A} , so it is a {B}",
        disjoint_step="{z} is a {A} , so it is not a {B}",
        quantities=("tube a", "tube b", "tube c", "tube d", "tube e", "tube f", "tube g", "tube h"),
        given="{x} holds {v} cells",
        add="{y} holds {k} more cells than {x}",
        sub="{y} holds {k} fewer cells than {x}",
        mul="{y} holds {k} times as many cells as {x}",
        num_question="how many cells does {y} hold ?",
        add_step="{y} holds {vx} plus {k} , so {v} cells",
        sub_step="{y} holds {vx} minus {k} , so {v} cells",
        mul_step="{y} holds {vx} times {k} , so {v} cells",
        cue="the run was recorded in lab {c} .",
        cue_words={"yes": "east", "no": "west"},
    ),
}


def get_domain(name: str) -> Domain:
    try:
        return DOMAINS[name]
    except KeyError:
        raise UserError(
            f"unknown domain {name!r}: the generator knows {', '.join(DOMAINS)}"
        ) from None


def parse_domain_list(text: str | None, default=DEFAULT_DOMAINS) -> tuple[str, ...]:
    """``"math,legal"`` -> ``("math", "legal")``; rejects empty items and duplicates."""
    if text is None:
        return tuple(default)
    names = tuple(p.strip() for p in text.split(","))
    if not names or any(not n for n in names):
        raise UserError(f"--domains {text!r}: expected a comma-separated list such as math,legal")
    if len(set(names)) != len(names):
        raise UserError(f"--domains {text!r}: a domain is listed twice")
    return names
