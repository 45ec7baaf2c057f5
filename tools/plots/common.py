"""Shared plumbing for the memsim plotting commands: input errors, JSON loading, checked
field access and all-or-nothing output.

Every command first reads and validates all of its input, then writes. Input problems
raise InputError, which memsim_plots.py turns into one stderr line and exit code 2, so
users see what to fix instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, NoReturn


class InputError(Exception):
    """Bad user input: the message names the file and says how to fix it."""


def load_json(path: Path) -> Any:
    """Parses a JSON file, turning unreadable or corrupt files into InputError."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            "the file is truncated or corrupt, regenerate it") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 JSON file; regenerate it") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply to be a memsim or PyTorch file") from None
    except ValueError as e:  # e.g. an integer beyond Python's digit limit
        raise InputError(f"{path}: not usable JSON ({e})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None


def is_number(value: Any) -> bool:
    """True for JSON numbers a float holds: bool is an int subclass in Python but not a
    number here, and neither is NaN, an infinity or an integer beyond a double's range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def shown(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters, for a message about bad input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def number(mapping: dict, key: str, where: str) -> float:
    """mapping[key] as a float, or InputError naming `where` (file and location)."""
    if key not in mapping:
        raise InputError(f"{where}: missing '{key}'")
    value = mapping[key]
    if not is_number(value):
        raise InputError(f"{where}: '{key}' is {shown(value)}, expected a finite number")
    return float(value)


def optional_number(mapping: dict, key: str, where: str) -> float | None:
    """mapping[key] as a float when present and not null, else None."""
    if mapping.get(key) is None:
        return None
    return number(mapping, key, where)


def typed(mapping: dict, key: str, kind: type, where: str) -> Any:
    """mapping[key] checked to be of `kind`, or InputError naming `where`."""
    if key not in mapping:
        raise InputError(f"{where}: missing '{key}'")
    value = mapping[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InputError(f"{where}: '{key}' is a {type(value).__name__}, "
                         f"expected a {kind.__name__}")
    return value


def existing_dir(path: Path, what: str, hint: str) -> Path:
    """`path` if it is a folder, else InputError saying what was expected there."""
    if not path.is_dir():
        problem = "is not a folder" if path.exists() else "does not exist"
        raise InputError(f"{what} {path} {problem}; {hint}")
    return path


class Output:
    """Writes a command's output files all-or-nothing.

    Files are written under temporary names beside their final ones and renamed into
    place together when the `with` block ends without an error (or on commit()), so no
    reader sees a half-written file. If the command fails part-way, the temporary files
    and the folders this object created are removed and existing files are untouched:
    an error leaves nothing new behind.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[str, Path]] = []  # (temporary file, final path)
        self._created_dirs: list[Path] = []

    def __enter__(self) -> Output:
        return self

    def __exit__(self, kind: type | None, *_: Any) -> None:
        if kind is None:
            self.commit()
            self._created_dirs.clear()
        else:
            self.discard()

    def make_dir(self, path: Path) -> Path:
        """Creates `path` and its missing parents, remembering them for cleanup."""
        missing = [p for p in [path, *path.parents] if not p.exists()]
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create folder {path} ({e.strerror})") from None
        self._created_dirs.extend(missing)
        return path

    def make_staging_dir(self, parent: Path) -> Path:
        """A fresh hidden folder in `parent` to assemble a result folder in before
        renaming it into place; removed again if the command fails."""
        path = Path(tempfile.mkdtemp(dir=self.make_dir(parent), prefix=".staging-"))
        os.chmod(path, 0o777 & ~_umask())  # mkdtemp makes it private; results are not
        self._created_dirs.append(path)
        return path

    def write(self, path: Path, writer: Callable[[str], None]) -> None:
        """Calls writer(temporary_path); the file becomes `path` on commit()."""
        self.make_dir(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        self._pending.append((tmp, path))
        writer(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; outputs are not

    def write_text(self, path: Path, text: str) -> None:
        """Writes a UTF-8 text file."""
        self.write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    def save_figure(self, fig: Any, dpi: float, *paths: Path) -> None:
        """Saves a matplotlib figure to each path (format from the suffix), then closes it."""
        import matplotlib.pyplot as plt

        try:
            for path in paths:
                self.write(path, lambda tmp, path=path: fig.savefig(
                    tmp, dpi=dpi, format=path.suffix.lstrip("."), bbox_inches="tight"))
        finally:
            plt.close(fig)

    def commit(self) -> None:
        """Renames every file written so far to its final name. The folders created stay
        on record, so a later failure in the `with` block still removes them."""
        for tmp, path in self._pending:
            os.replace(tmp, path)
        self._pending.clear()

    def discard(self) -> None:
        """Removes the uncommitted files and the folders created for them."""
        for tmp, _ in self._pending:
            Path(tmp).unlink(missing_ok=True)
        for folder in self._created_dirs:  # nested ones may be gone already: rmtree copes
            shutil.rmtree(folder, ignore_errors=True)
        self._pending.clear()
        self._created_dirs.clear()


def _umask() -> int:
    """The process umask (readable only by setting it, so set it back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one stderr line and exit code 2, like
    every other memsim error, instead of argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive(text: str) -> float:
    """An argparse type for sizes and resolutions, which must be above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def command_parser(command: str, description: str) -> CommandParser:
    """The parser for `memsim <command>`, named so --help shows what users type."""
    return CommandParser(prog=f"memsim {command}", description=description,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
