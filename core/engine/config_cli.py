"""Command-line options generated from a pydantic model's fields, so a command's
``--help`` says what the model says: one ``--field-name`` per field, its type from the
annotation, its help from the field's description and its default from the field.

An option left off the command line stays off the namespace (``argparse.SUPPRESS``),
so the model's own default applies; ``--help`` still shows that default.

Field types and their options:

- ``int``, ``float``, ``str`` (also ``X | None``): ``--name VALUE`` of that type.
- ``Literal[...]``: ``--name {a,b,...}``.
- ``bool``: ``--name`` / ``--no-name``; a field ``enable_x`` also answers to ``--x`` / ``--no-x``.
- ``dict``: ``--name JSON``, a JSON object the model's validator parses.
- ``list[str]``: ``--name A,B``, a comma-separated string the model's validator splits.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

SCALARS = (int, float, str)


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model_cls: type[BaseModel],
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Add an option for each field of ``model_cls`` (those in ``only`` when given, none in
    ``skip``), in declaration order; returns the field names added.

    ``overrides`` maps a field name to argparse keywords that replace the generated ones
    (a command's own ``default``, ``choices`` or ``help``); an overridden ``default`` is
    always set on the namespace."""
    fields = model_cls.model_fields
    names = list(fields) if only is None else list(only)
    unknown = [n for n in [*names, *(overrides or {})] if n not in fields]
    if unknown:
        raise ValueError(f"{model_cls.__name__} has no field(s) {', '.join(unknown)}. Fields: {', '.join(fields)}.")
    added = []
    for name in names:
        if name in skip:
            continue
        field = fields[name]
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, **_type_kwargs(model_cls, name, field)}
        kwargs.update((overrides or {}).get(name, {}))
        help_text = kwargs.get("help", field.description or "").replace("%", "%%")
        if kwargs["default"] is argparse.SUPPRESS:
            shown = default_text(field_default(field)).replace("%", "%%")
            kwargs["help"] = f"{help_text} (default: {shown})"
        else:  # a default the command sets, which argparse fills in
            kwargs["help"] = f"{help_text} (default: %(default)s)"
        parser.add_argument(*_flags(name, field), **kwargs)
        added.append(name)
    return added


def field_default(field: FieldInfo) -> Any:
    return field.get_default(call_default_factory=True)


def default_text(default: Any) -> str:
    """How ``--help`` shows a default: ``str()``, except a list as its comma-separated form."""
    if isinstance(default, (list, tuple)):
        return ",".join(str(item) for item in default)
    return str(default)


def _flags(name: str, field: FieldInfo) -> list[str]:
    flags = [option_name(name)]
    if field.annotation is bool and name.startswith("enable_"):
        flags.append(option_name(name.removeprefix("enable_")))  # --no-prefix-caching
    return flags


def _type_kwargs(model_cls: type[BaseModel], name: str, field: FieldInfo) -> dict[str, Any]:
    annotation = _without_none(field.annotation)
    origin = get_origin(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        choices = get_args(annotation)
        return {"type": type(choices[0]), "choices": choices}
    if annotation in SCALARS:
        return {"type": annotation}
    if annotation is dict or origin is dict:
        return {"type": str, "metavar": "JSON"}
    if origin is list and get_args(annotation) == (str,):
        return {"type": str, "metavar": "A,B"}
    raise TypeError(
        f"{model_cls.__name__}.{name} is a {field.annotation!r}, which has no command-line form. "
        "Use int, float, str, bool, a Literal, dict or list[str] (optionally | None), or teach engine/config_cli.py "
        "the new type."
    )


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def given_settings(model_cls: type[BaseModel], namespace: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``model_cls`` the namespace holds (the options given, and positionals)."""
    return {name: getattr(namespace, name) for name in model_cls.model_fields if hasattr(namespace, name)}


def config_from_namespace(model_cls: type[BaseModel], namespace: argparse.Namespace) -> Any:
    """``model_cls`` built from the namespace; a validation error becomes a ``ValueError``
    naming the options (see :func:`option_errors`)."""
    try:
        return model_cls(**given_settings(model_cls, namespace))
    except ValidationError as exc:
        raise ValueError(option_errors(exc)) from None


def option_errors(exc: ValidationError) -> str:
    """A pydantic error as option names: '--max-num-seqs: Input should be greater than or equal to 1'."""
    parts = []
    for error in exc.errors():
        name = "--" + "-".join(str(p) for p in error["loc"]).replace("_", "-")
        parts.append(f"{name}: {error['msg']}")
    return "; ".join(parts)
