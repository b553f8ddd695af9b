"""Directories closed with a manifest of every file's size and SHA-256, and checked against it when read:
checkpoints, the tokenized-data cache and the converted embedded model (the caches under `cache_root`). Standard
library only."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NOT_A_MANIFEST = f"damaged ({MANIFEST} is not a manifest of this format)"


def cache_root(cache_dir: str | None = None) -> Path:
    """Return where the converted default model and tokenized datasets live (--cache_dir overrides)."""
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "reft-alpaca"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, **fields) -> None:
    """Write the manifest: `fields` and every file of `directory` (flat, as save_pretrained, save_to_disk and
    checkpoints write)."""
    files = {path.name: {"bytes": path.stat().st_size, "sha256": sha256(path)}
             for path in sorted(directory.iterdir()) if path.name != MANIFEST}
    with open(directory / MANIFEST, "w") as file:  # a plain write: a full disk surfaces as OSError(ENOSPC)
        file.write(json.dumps({**fields, "files": files}, indent=2))


def read_manifest(directory: Path) -> dict | str:
    """Return the manifest as a dict, or what is wrong with it (missing or not JSON: its writing never finished)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"incomplete ({MANIFEST} is missing or unreadable)"
    return manifest if isinstance(manifest, dict) else _NOT_A_MANIFEST


def _is_entry(name, entry) -> bool:
    """Tell whether a manifest entry is a file of the directory itself (no path that leads elsewhere) with a size and a
    SHA-256."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name and "\\" not in name
            and isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"]) is not None)


def files_problem(directory: Path, manifest: dict, required: tuple[str, ...] = ()) -> str | None:
    """Return what is wrong with `directory` against its manifest (any shape but the expected one counts as damage),
    or None if every file it lists, `required` among them, is there with its size and SHA-256."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files or not all(_is_entry(name, entry) for name, entry in files.items()):
        return _NOT_A_MANIFEST
    missing = [name for name in required if name not in files]
    if missing:
        return f"damaged ({MANIFEST} does not list {missing[0]})"
    for name, expected in files.items():
        file = directory / name
        if not file.is_file() or file.stat().st_size != expected["bytes"]:
            return f"incomplete ({name} is missing or cut short)"
        if sha256(file) != expected["sha256"]:
            return f"damaged ({name} does not match its SHA-256 in {MANIFEST})"
    return None


def directory_problem(directory: Path) -> str | None:
    manifest = read_manifest(directory)
    return manifest if isinstance(manifest, str) else files_problem(directory, manifest)


def cached_directory(path: Path, build: Callable[[Path], None], what: str) -> Path:
    """Return `path`, a cache directory that `build(directory)` fills: reused when it matches its manifest, else
    (re)built, with a one-line notice if it was there but damaged. Built next to it and renamed into place, so
    concurrent first runs (ranks, parallel jobs) never see half of one: the first rename wins, the others drop
    their copy."""
    problem = directory_problem(path) if path.exists() else None
    if path.exists() and problem is None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if problem is not None:
        print(f"warning: {what} in {path} is {problem}; building it again", file=sys.stderr, flush=True)
        discard(path)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=path.parent))
    try:
        build(staging)
        write_manifest(staging)
        os.rename(staging, path)
    except OSError:
        if not path.exists():  # not a rename lost to another process: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def discard(path: Path) -> None:
    """Remove a directory: renamed aside first, so that the name is free at once and only one process (of
    several that found it damaged) removes it."""
    aside = tempfile.mkdtemp(prefix=f".discarded-{path.name}-", dir=path.parent)  # an empty directory: replaced
    try:
        os.rename(path, aside)
    except OSError:  # another process moved it first
        pass
    shutil.rmtree(aside, ignore_errors=True)
