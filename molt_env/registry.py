"""Find an environment by name: Gymnasium's registry plus short names and import paths.

`make(spec)` accepts
  - a short name registered with `register` (`molt-train --env arithmetic`),
  - a Gymnasium id (`molt/Arithmetic-v0`, or any other registered id),
  - `family:task` for a family registered with `register_family`
    (`reasoning_gym:leg_counting`: one adapter, many tasks),
  - `package.module:Class`,
  - `path/to/file.py:Class`.
Environments registered here are Gymnasium environments too:
`gymnasium.make("molt/Arithmetic-v0")` works once the module that registers
it is imported. A package makes its environments known by name by declaring
that module as an entry point in the `molt.environments` group (the bundled
`environments` package does, in pyproject.toml); the registry imports those
modules the first time a name is looked up.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import gymnasium

_SHORT_NAMES: dict[str, str] = {}  # short name -> Gymnasium id
_FAMILIES: dict[str, str] = {}  # family prefix -> entry point taking the task name first


def gym_id(name: str) -> str:
    """The Gymnasium id of short name `name`: `guess_number` -> `molt/GuessNumber-v0`."""
    return "molt/" + "".join(part.capitalize() for part in name.replace("-", "_").split("_")) + "-v0"


def register(name: str, entry_point: str | type, **kwargs) -> str:
    """Register `entry_point` under short `name` and as `molt/<Name>-v0`; returns the Gymnasium id.

    `kwargs` are the environment's constructor defaults.
    """
    env_id = gym_id(name)
    gymnasium.register(id=env_id, entry_point=entry_point, kwargs=kwargs)
    _SHORT_NAMES[name] = env_id
    return env_id


def register_family(prefix: str, entry_point: str) -> None:
    """`make("prefix:task")` builds `entry_point(task)`: an adapter over a library of tasks."""
    _FAMILIES[prefix] = entry_point


def registered() -> dict[str, str]:
    """Short names and their Gymnasium ids."""
    _load_entry_points()
    return dict(_SHORT_NAMES)


ENTRY_POINTS = "molt.environments"  # entry-point group of modules that register environments on import
_entry_points_loaded = False


def _load_entry_points() -> None:
    """Import every installed package's registering module, once per process."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINTS):
            entry_point.load()


_FILE_MODULES: dict[tuple[str, str], str] = {}  # (path/to/file.py, working directory) -> its module's name


def load_class(spec: str):
    """The class named by `package.module:Class` or `path/to/file.py:Class`."""
    target, _, attribute = spec.rpartition(":")
    if not target or not attribute:
        raise ValueError(f"{spec!r}: expected package.module:Class or path/to/file.py:Class")
    if target.endswith(".py"):
        where = (target, os.getcwd())  # a relative path names another file from another directory
        module_name, path = _FILE_MODULES.get(where), Path(target)
        if module_name is None:  # (resolving a path costs a system call per directory: once per file)
            if not path.is_file():
                raise ValueError(f"{spec!r}: no file {path}")
            module_name = _FILE_MODULES[where] = f"molt_user_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:  # load a file once per process, like an import
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ValueError(f"{spec!r}: cannot import {target} ({error})") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"{spec!r}: {target} has no attribute {attribute!r}") from None


def make(spec: str, **kwargs):
    """Instantiate the environment named by `spec` (see the module docstring)."""
    _load_entry_points()
    prefix, _, task = spec.partition(":")
    if task and prefix in _FAMILIES:
        return load_class(_FAMILIES[prefix])(task, **kwargs)
    if ":" in spec and not spec.startswith("molt/"):
        return load_class(spec)(**kwargs)
    env_id = _SHORT_NAMES.get(spec, spec)
    try:
        # The plain environment: the runner enforces turn limits itself and
        # calls its async methods, which Gymnasium's wrappers do not forward.
        return gymnasium.make(env_id, disable_env_checker=True, **kwargs).unwrapped
    except gymnasium.error.Error as error:
        known = ", ".join(sorted(_SHORT_NAMES)) or "none registered"
        raise ValueError(
            f"unknown environment {spec!r} ({error}). Known short names: {known}; "
            "or pass package.module:Class or path/to/file.py:Class"
        ) from None
