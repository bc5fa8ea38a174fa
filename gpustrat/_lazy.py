"""Modules whose public names load on first use, as in scientific Python's lazy_loader.

A namespace module such as :mod:`gpustrat.distribute` lists its names in a table and
calls :func:`attach`; a name's defining module is imported when the name is first read,
so that importing the namespace itself imports nothing (no MPI, no device probing).
``dir()`` lists every name of the table before any of them is loaded.
"""

from __future__ import annotations

import importlib
import sys


def attach(module_name: str, names: dict[str, str], submodules: tuple[str, ...] = ()):
    """``(__getattr__, __dir__)`` for module ``module_name``.

    Args:
        module_name: the namespace module's ``__name__``.
        names: ``{public name: "defining.module"}`` (the attribute of the same name), or
            ``"defining.module:attr"`` where the defining module spells it differently.
        submodules: names of submodules of ``module_name`` reachable as attributes.
    """

    def __getattr__(name: str):
        if name in submodules:
            value = importlib.import_module(f"{module_name}.{name}")
        elif name in names:
            where, _, attr = names[name].partition(":")
            value = getattr(importlib.import_module(where), attr or name)
        else:
            from gpustrat._porting import attribute_error  # noqa: PLC0415
            raise attribute_error(module_name, name)
        setattr(sys.modules[module_name], name, value)  # later reads skip this hook
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(names) | set(submodules))

    return __getattr__, __dir__
