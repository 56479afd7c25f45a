"""The package's public face (`subengine.__all__`) is imported on first use: every name it
lists resolves, to the object its defining module holds, and the table of lazily imported
names lists exactly `__all__` (less the two functions defined in the package itself). No
database."""

from __future__ import annotations

import importlib

from helpers import fresh_python

import subengine

DEFINED_IN_THE_PACKAGE = {"migration_sql", "stop_embedded"}


def test_the_lazy_table_names_exactly_the_public_names() -> None:
    assert set(subengine._PUBLIC) | DEFINED_IN_THE_PACKAGE == set(subengine.__all__)
    assert len(subengine.__all__) == len(set(subengine.__all__))


def test_every_public_name_is_what_its_module_defines() -> None:
    for name, module in subengine._PUBLIC.items():
        assert getattr(subengine, name) is getattr(importlib.import_module(module), name), name


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        subengine.NoSuchName  # noqa: B018
    except AttributeError as error:
        assert "NoSuchName" in str(error)
    else:
        raise AssertionError("subengine.NoSuchName resolved")


def test_a_star_import_gives_every_public_name() -> None:
    probe = (
        "from subengine import *; import subengine; "
        "missing = [n for n in subengine.__all__ if n not in globals()]; print(missing)"
    )
    assert fresh_python(probe) == "[]"
