"""Where records come from, told from --data_path alone: data files (a file or a glob of them) and the `datasets`
loader that reads them, a directory written by `datasets`' save_to_disk, another local directory, or a hub name.
Standard library only: the scripts check the path before torch and `datasets` are imported."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from alpaca.errors import UsageError

# `datasets`' packaged loader of each kind of data file; a compressed one (.jsonl.gz) is read as its kind.
DATA_FILE_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
ACCEPTED = ("a .json, .jsonl, .parquet, .csv or .arrow file (or a glob of them), a save_to_disk directory, or a "
            "hub dataset name")
HUB_NAME = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")


@dataclass(frozen=True)
class DataSource:
    kind: str  # "files" (read by `loader`), "saved" (save_to_disk), "directory" (data files found by datasets), "hub"
    path: str
    loader: str | None = None
    files: tuple[str, ...] = ()


def data_file_loader(path: str) -> str | None:
    """Return the `datasets` loader of a data file, told from its name (a .jsonl.gz by its kind), or None."""
    name = path.lower()
    for compression in COMPRESSIONS:
        name = name.removesuffix(compression)
    return DATA_FILE_LOADERS.get(os.path.splitext(name)[1])


def file_loader(flag: str, path: str) -> str:
    loader = data_file_loader(path)
    if loader is None:
        raise UsageError(f"{flag} {path!r} is not a data file datasets reads; pass {ACCEPTED}")
    return loader


def data_source(flag: str, path: str) -> DataSource:
    """Tell what `path` is: an existing file is read as itself, even where its name holds glob characters; a local
    path that names nothing is refused here, at argument time."""
    if os.path.isdir(path):
        saved = any(os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))
        return DataSource("saved" if saved else "directory", path)
    if os.path.isfile(path):  # a file named data[1].json is that file, not a pattern
        files = [path]
    elif glob.has_magic(path):
        files = sorted(file for file in glob.glob(path, recursive=True) if os.path.isfile(file))
        if not files:
            raise UsageError(f"{flag} {path!r} matches no file; pass {ACCEPTED}")
    elif HUB_NAME.fullmatch(path) and not path.lower().endswith((*DATA_FILE_LOADERS, *COMPRESSIONS)):
        return DataSource("hub", path)
    else:
        raise UsageError(f"{flag} {path!r} does not exist; pass {ACCEPTED}")
    loaders = {file_loader(flag, file) for file in files}
    if len(loaders) > 1:
        raise UsageError(f"{flag} {path!r} matches files of several kinds ({', '.join(sorted(loaders))}); pass "
                         "files of one kind")
    return DataSource("files", path, loaders.pop(), tuple(files))
