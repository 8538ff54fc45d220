"""What every iga-ds config section shares: strict typed fields with their documentation on
them, and one validator that turns any error into one line naming the dotted key.

Sections are pydantic models (pydantic v2 comes with DeepSpeed, whose own config is built the
same way). Fields are strict: ``true`` is not a seed, ``2.0`` not a layer count, ``"2"`` not a
number of waves; the one leniency is a number written in scientific notation without a dot
(``2e-4``), which YAML 1.1 reads as a string. Every number is finite (``.inf`` and ``.nan``
are refused, in typed fields and in free-form mappings such as method parameters alike). A
field may say what it expects in words (``expected=``); otherwise the words come from its type.
"""
from __future__ import annotations

import math
import types
import typing
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from iga_ds.errors import ConfigError


class Section(BaseModel):
    """A block of a config file: unknown keys and wrong types are errors."""

    model_config = ConfigDict(strict=True, extra="forbid", validate_default=False, allow_inf_nan=False)
    # a value of the wrong type is described by the field's rule ("a positive integer") rather
    # than by its type ("an integer")
    describe_by_rule: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


def setting(default: Any = ..., doc: str = "", expected: str | None = None, **constraints: Any) -> Any:
    """A documented field: ``doc`` is its documentation (docs/CONFIG.md is generated from it),
    ``expected`` what an error message says it wants, ``constraints`` pydantic's (ge, gt, ...)."""
    extra = {"expected": expected} if expected else None
    if callable(default):  # a factory: a section class, dict, list or a lambda
        return Field(default_factory=default, description=doc, json_schema_extra=extra, **constraints)
    return Field(default, description=doc, json_schema_extra=extra, **constraints)


def _yaml_number(value: Any) -> Any:
    # YAML 1.1 reads "2e-4" (no dot) as a string; accept it as the number it spells
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# a float field that also takes integers and "2e-4"
Number = typing.Annotated[float, BeforeValidator(_yaml_number)]


def first_non_finite(value: Any, key: str = "") -> tuple[str, float] | None:
    """(dotted key, value) of the first NaN or infinity in a free-form value (mappings, lists,
    numbers), or None: what typed fields refuse, looked for where the type is ``Any``."""
    if isinstance(value, float) and not math.isfinite(value):
        return key, value
    if isinstance(value, dict):
        items = ((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{key}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for inner_key, inner in items:
        found = first_non_finite(inner, inner_key)
        if found is not None:
            return found
    return None


def finite_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` when every number in it is finite; else an error naming the key below the field."""
    found = first_non_finite(params)
    if found is not None:
        raise config_problem(f"{found[0]}: expected a finite number, got {found[1]!r}", nested=True)
    return params


def config_problem(message: str, nested: bool = False) -> PydanticCustomError:
    """An error raised inside a validator; ``nested``: the message starts with a key below the
    field's own (``width: unknown key`` under ``model.tiny``)."""
    return PydanticCustomError("iga_config", "{message}", {"message": message, "nested": nested})


# -- errors in words ------------------------------------------------------------------------------


def type_phrase(tp: Any) -> str:
    """What a type annotation accepts, in words: ``a list of a string or null``."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return type_phrase(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(type_phrase(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is Literal:
        choices = [f'"{c}"' if isinstance(c, str) else repr(c) for c in typing.get_args(tp)]
        return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"a list of {type_phrase(arg)}"
    if origin is dict or tp is dict or (isinstance(tp, type) and issubclass(tp, BaseModel)):
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false", Any: "any value"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _field_at(model: type[BaseModel], loc: tuple) -> tuple[FieldInfo | None, Any, type[BaseModel]]:
    """The field an error location points at, the type of the value there, and the section
    that holds the field."""
    info, tp, owner = None, model, model
    for part in loc:
        if isinstance(part, int):  # an item of a list
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            inner = typing.get_args(args[0]) if args and typing.get_origin(args[0]) is list else typing.get_args(tp)
            tp = inner[0] if inner else Any
            continue
        while typing.get_origin(tp) in (Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if not (isinstance(tp, type) and issubclass(tp, BaseModel)) or part not in tp.model_fields:
            return None, Any, owner
        owner, info = tp, tp.model_fields[part]
        tp = info.annotation
    return info, tp, owner


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _parent_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    if not loc[:-1]:
        return list(model.model_fields)
    _, tp, _ = _field_at(model, loc[:-1])
    while typing.get_origin(tp) in (Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def error_line(model: type[BaseModel], error: dict, prefix: str = "") -> str:
    """One pydantic error as ``key: expected ..., got ...``."""
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
    key = _dotted(((prefix,) if prefix else ()) + loc)
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key; expected one of: {', '.join(_parent_fields(model, loc))}"
    if error["type"] == "iga_config":
        ctx = error.get("ctx", {})
        if not key:
            return ctx["message"]
        return f"{key}.{ctx['message']}" if ctx.get("nested") else f"{key}: {ctx['message']}"
    info, tp, owner = _field_at(model, loc)
    if error["type"] == "finite_number":
        rule = (info.json_schema_extra or {}).get("expected") if info is not None else None
        return f"{key}: expected {rule or 'a number'} (finite), got {error['input']!r}"
    if error["type"] == "missing":
        return f"{key}: missing; expected {type_phrase(tp)}"
    rule = (info.json_schema_extra or {}).get("expected") if info is not None and loc and \
        not isinstance(loc[-1], int) else None
    wrong_type = error["type"].endswith(("_type", "_parsing")) or error["type"] in ("model_type", "literal_error")
    if wrong_type and not getattr(owner, "describe_by_rule", False) and error["type"] != "literal_error":
        rule = None  # a value of the wrong type: say which type
    return f"{key}: expected {rule or type_phrase(tp)}, got {error['input']!r}"


def validate_section(model: type[BaseModel], raw: Any, where: str = "") -> Any:
    """``model`` built from ``raw``, or a ConfigError naming the first bad key (under ``where``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {raw!r}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(error_line(model, exc.errors(include_url=False)[0], where)) from None
