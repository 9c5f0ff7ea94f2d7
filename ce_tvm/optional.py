"""Optional dependencies: an import that fails names the extra that installs it.

``guard(package, extra, what)`` around the imports of ``package`` (or
``require(...)``, which imports it) turns their failure into one
``MissingExtra`` (a ``ModuleNotFoundError``) whose message says what needs the
package and what to install: ``pip install "ce-tvm[extra]"``. A failure of
anything else (a dependency of the package itself, say) passes unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from collections.abc import Iterator
from types import ModuleType


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed (or not in a version that has what
    ce_tvm imports from it); the message names the extra that installs it."""


def _within(name: str | None, package: str) -> bool:
    return name is not None and (name == package or name.startswith(package + "."))


def _message(package: str, extra: str, what: str, alternative: str, error: ImportError) -> str:
    install = f'pip install "ce-tvm[{extra}]"' + (f", or {alternative}" if alternative else "")
    try:
        importlib.import_module(package)
    except ImportError as failed:
        if not _within(failed.name, package):
            raise  # the package is there, but something it imports is not
        if isinstance(failed, ModuleNotFoundError) and failed.name == package:
            return f"{what} needs {package}, which is not installed: {install}"
        error = failed
    try:
        version = f" {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return (f"{what} needs {package} in a version the extra {extra!r} allows "
            f"({package}{version} is installed: {error}): {install}")


@contextlib.contextmanager
def guard(package: str, extra: str, what: str, alternative: str = "") -> Iterator[None]:
    """Imports of ``package`` (top-level name) inside this block that fail raise
    ``MissingExtra`` naming ``extra`` (``alternative``: another way out, e.g. a flag
    that skips what needs it). ``what``: who needs it, for the message."""
    try:
        yield
    except ImportError as e:
        if not _within(e.name, package):
            raise
        raise MissingExtra(_message(package, extra, what, alternative, e), name=package) from None


def require(package: str, extra: str, what: str, alternative: str = "") -> ModuleType:
    """``import package``, or ``MissingExtra`` naming ``extra`` (``guard``)."""
    with guard(package, extra, what, alternative):
        return importlib.import_module(package)
