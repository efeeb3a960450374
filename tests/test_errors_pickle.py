"""Every exception class of dice_ray survives pickling with its attributes: errors cross Ray actors and
worker processes (a TaskError raised in an actor, a CompileError sent back from a worker), and an
exception whose ``__init__`` takes other arguments than its ``args`` fails to unpickle on the far side,
hiding the real error behind a TypeError."""

import importlib
import inspect
import pickle
import pkgutil

import pytest

import dice_ray
from dice_ray.cluster.auth import GcsProbe

# constructor arguments that are not strings, by parameter name
ARGUMENTS = {"probe": GcsProbe("closed", "connection refused")}


def _exception_classes():
    found = []
    for info in pkgutil.walk_packages(dice_ray.__path__, "dice_ray."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == info.name:
                found.append(pytest.param(cls, id=f"{info.name}.{name}"))
    return found


CLASSES = _exception_classes()


def test_the_walk_finds_the_known_kinds():
    names = {p.id.rsplit(".", 1)[1] for p in CLASSES}
    assert {"TaskError", "CompileError", "RuleBroken", "InputFileError", "WorkerError"} <= names


@pytest.mark.parametrize("cls", CLASSES)
def test_exception_round_trips_through_pickle(cls):
    params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    error = cls(*[ARGUMENTS.get(p.name, f"arg{i}") for i, p in enumerate(params)])
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and str(copy) == str(error)
    assert vars(copy) == vars(error)
