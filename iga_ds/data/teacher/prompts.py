"""The three teacher prompts, read from editable template files.

A template has a ``### system`` section and a ``### user`` section. Placeholders are
``{seed_problem}``, ``{dag_json}``, ``{domain_name}``, ``{domain_description}``,
``{domain_problem}`` and ``{min_score}``; they are replaced literally, so the JSON braces in
the prompt text need no escaping. The defaults ship in ``iga_ds/data/templates/``; pass a
directory holding files of the same names to use edited copies.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from iga_ds.data.domains import DOMAIN_DESCRIPTIONS
from iga_ds.errors import UserError
from iga_ds.files import read_text

TEMPLATE_NAMES = ("dag_extraction", "domain_instantiation", "quality_verification")
PLACEHOLDERS = ("seed_problem", "dag_json", "domain_name", "domain_description",
                "domain_problem", "min_score")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


@dataclass(frozen=True)
class Template:
    name: str
    system: str
    user: str

    def render(self, **values: str) -> list[dict]:
        unknown = set(values) - set(PLACEHOLDERS)
        if unknown:
            raise KeyError(f"unknown placeholders {sorted(unknown)}")
        # one pass, so text inside a value (a seed problem with braces) is never substituted
        def fill(text: str) -> str:
            return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)

        system, user = fill(self.system), fill(self.user)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        return messages


def parse_template(name: str, text: str, source: str) -> Template:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = line.strip().lower()
        if head in ("### system", "### user"):
            current = head[4:]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    if "user" not in sections:
        raise UserError(f"{source}: template {name!r} needs a '### user' section "
                        "(and optionally a '### system' section before it)")
    return Template(name, "\n".join(sections.get("system", [])).strip(),
                    "\n".join(sections["user"]).strip())


class Prompts:
    """The three prompts, from the package defaults or from ``templates_dir``."""

    def __init__(self, templates_dir: str | Path | None = None):
        self.templates: dict[str, Template] = {}
        for name in TEMPLATE_NAMES:
            if templates_dir is not None:
                path = Path(templates_dir) / f"{name}.txt"
                if not path.is_file():
                    raise UserError(f"--templates {templates_dir}: missing {name}.txt")
                text, source = read_text(path, "template", UserError), str(path)
            else:
                res = resources.files("iga_ds.data") / "templates" / f"{name}.txt"
                text, source = res.read_text(encoding="utf-8"), f"iga_ds/data/templates/{name}.txt"
            self.templates[name] = parse_template(name, text, source)

    def fingerprint(self) -> str:
        """sha256 over the templates, recorded so a resumed build uses the same prompts."""
        h = hashlib.sha256()
        for name in TEMPLATE_NAMES:
            t = self.templates[name]
            h.update(f"{name}\0{t.system}\0{t.user}\0".encode())
        return h.hexdigest()

    def dag_extraction(self, seed_problem: str) -> list[dict]:
        return self.templates["dag_extraction"].render(seed_problem=seed_problem)

    def domain_instantiation(self, dag: dict, domain: str) -> list[dict]:
        return self.templates["domain_instantiation"].render(
            dag_json=json.dumps(dag, ensure_ascii=False), domain_name=domain,
            domain_description=DOMAIN_DESCRIPTIONS.get(domain, domain))

    def quality_verification(self, seed_problem: str, domain_problem: str, dag: dict,
                             min_score: float) -> list[dict]:
        return self.templates["quality_verification"].render(
            seed_problem=seed_problem, domain_problem=domain_problem,
            dag_json=json.dumps(dag, ensure_ascii=False), min_score=f"{min_score:g}")
