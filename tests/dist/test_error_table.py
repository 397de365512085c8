"""A failure on one rank reaches its peers with its type, its message and its fields: every public error class of
``hp_fastload.errors`` (and every exception class ``hp_fastload`` exports), enumerated from the modules so that a
class added without its entry in the table fails here, raised on rank 0 of two gloo ranks inside an agreed step
(``dist.agree.agree``, the all-gather agreement of ``load`` / ``save``) and inside a bounded one
(``dist.bounded.agree_bounded``, ``from_pretrained``'s ``parallelize``). Builtin exceptions arrive as themselves
(``OSError``'s ``errno`` / ``filename`` too); an exception of another library, or a private subclass, arrives as
its nearest table or builtin ancestor. One spawn for the module."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

import hp_fastload
from hp_fastload import errors
from tests.helpers.dist import run_distributed

#: A value for each extra field an error class takes after its message (a new field needs its sample here).
_SAMPLES: dict[str, Any] = {
    "bucket": "weights",
    "key": "model-00001.safetensors",
    "status": 403,
    "ranks": (1, 3),
    "nodes": (0, 1),
    "missing_keys": ("lm_head.weight", "model.norm.weight"),
    "unexpected_keys": ("extra.bias",),
}
_OS_FIELDS = ("errno", "strerror", "filename", "filename2")


def _public_error_classes() -> list[type[BaseException]]:
    """Every exception class defined in ``hp_fastload.errors`` or exported by ``hp_fastload``."""
    found = {
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    }
    found |= {
        obj
        for name in hp_fastload.__all__
        if isinstance(obj := getattr(hp_fastload, name), type) and issubclass(obj, BaseException)
    }
    return sorted(found, key=lambda cls: cls.__name__)


def _extra_fields(cls: type[BaseException]) -> dict[str, Any]:
    """The class's constructor arguments after the message, with sample values (none for a class that keeps
    ``Exception``'s constructor)."""
    init = cls.__init__
    if not inspect.isfunction(init):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = [p for p in inspect.signature(init).parameters.values() if p.kind in kinds]
    return {p.name: _SAMPLES[p.name] for p in params[2:]}  # after self and the message


class _OwnValueError(ValueError):
    """A user's (or another library's) subclass of a builtin: its peers get the builtin."""


class _PrivatePlanError(errors.PlanError):
    """A subclass of a table class that is not in the table: its peers get the table class."""


def _builtin_cases() -> list[tuple[str, BaseException, type[BaseException]]]:
    """(case, the exception raised on rank 0, the class its peer raises)."""
    try:
        b"\xff".decode()
    except UnicodeDecodeError as exc:
        unicode_error = exc
    try:
        json.loads("{")
    except json.JSONDecodeError as exc:
        json_error = exc
    return [
        ("ValueError", ValueError("bad value"), ValueError),
        ("TypeError", TypeError("bad type"), TypeError),
        ("RuntimeError", RuntimeError("bad run"), RuntimeError),
        ("KeyError", KeyError("some.key"), KeyError),
        ("IndexError", IndexError("index 4 out of range"), IndexError),
        ("AttributeError", AttributeError("no attribute x"), AttributeError),
        ("NotImplementedError", NotImplementedError("not yet"), NotImplementedError),
        (
            "FileNotFoundError",
            FileNotFoundError(2, "No such file or directory", "/ckpt/config.json"),
            FileNotFoundError,
        ),
        ("PermissionError", PermissionError(13, "Permission denied", "/ckpt/model.safetensors"), PermissionError),
        ("IsADirectoryError", IsADirectoryError(21, "Is a directory", "/ckpt/x.safetensors"), IsADirectoryError),
        ("OSError", OSError(5, "Input/output error"), OSError),
        ("JSONDecodeError", json_error, ValueError),
        ("UnicodeDecodeError", unicode_error, UnicodeError),
        ("_OwnValueError", _OwnValueError("own"), ValueError),
        ("_PrivatePlanError", _PrivatePlanError("private"), errors.PlanError),
    ]


def _cases() -> list[tuple[str, BaseException, type[BaseException]]]:
    own = [
        (cls.__name__, cls(f"{cls.__name__} on rank 0: the model's tensor 'a.b'", **_extra_fields(cls)), cls)
        for cls in _public_error_classes()
    ]
    return own + _builtin_cases()


def _state(exc: BaseException) -> dict[str, Any]:
    """What must arrive: the class, the arguments, the instance's fields (and ``OSError``'s)."""
    state = {"class": f"{type(exc).__module__}.{type(exc).__qualname__}", "args": exc.args, "fields": vars(exc)}
    if isinstance(exc, OSError):
        state["os"] = {name: getattr(exc, name) for name in _OS_FIELDS}
    return state


def _raise(exc: BaseException) -> None:
    raise exc


def _body(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    from hp_fastload.dist.agree import agree
    from hp_fastload.dist.bounded import agree_bounded

    seen: dict[str, dict[str, Any]] = {}
    for how, protocol in (("agree", agree), ("bounded", agree_bounded)):
        for case, exc, _ in _cases():
            try:
                protocol("Checking the table", lambda exc=exc: _raise(exc) if rank == 0 else None)
            except Exception as raised:
                if rank == 0 and raised is not exc:
                    seen[f"{how}/{case}"] = {"error": f"rank 0 raised another exception: {raised!r}"}
                else:
                    seen[f"{how}/{case}"] = _state(raised)
            else:
                seen[f"{how}/{case}"] = {"error": "no exception"}
    return seen


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_body, 2, timeout=120)


def test_the_module_enumeration_finds_the_errors() -> None:
    names = {cls.__name__ for cls in _public_error_classes()}
    assert {
        "HpFastloadError",
        "ObjectStoreError",
        "PeerInterrupted",
        "PeerLost",
        "MissingKeysError",
        "ConversionError",
        "AdapterError",
        "AdapterMismatchError",
        "QuantizationError",
    } <= names


def test_every_error_class_has_its_entry_in_the_table() -> None:
    table = errors.ERROR_TABLE
    for cls in _public_error_classes():
        assert table.get(cls.__name__) is not None and table[cls.__name__].cls is cls, cls.__name__
        assert set(table[cls.__name__].fields) == set(_extra_fields(cls)), cls.__name__


@pytest.mark.parametrize("how", ["agree", "bounded"])
@pytest.mark.parametrize("case", [case for case, _, _ in _cases()])
def test_the_peer_raises_the_same_error(outcomes: list[dict[str, dict[str, Any]]], how: str, case: str) -> None:
    exc, expected_class = next((exc, cls) for name, exc, cls in _cases() if name == case)
    assert outcomes[0][f"{how}/{case}"] == _state(exc), "rank 0 raises its own exception, unchanged"
    peer = outcomes[1][f"{how}/{case}"]
    assert peer.get("class") == f"{expected_class.__module__}.{expected_class.__qualname__}", peer
    prefix = f"Checking the table failed on rank 0: {type(exc).__name__}: "
    if isinstance(exc, OSError) and exc.strerror is not None:
        # An OSError whose message is made of its fields keeps them: the rank's prefix goes before its strerror.
        expected = {name: getattr(exc, name) for name in _OS_FIELDS} | {"strerror": prefix + exc.strerror}
        assert peer["os"] == expected
        assert peer["args"][:2] == (exc.errno, prefix + exc.strerror)
    else:
        assert peer["args"] == (prefix + str(exc),)
        if isinstance(exc, OSError):
            assert peer["os"] == {name: getattr(exc, name) for name in _OS_FIELDS}
    if expected_class is type(exc):
        assert peer["fields"] == vars(exc)
