"""Read a data source (alpaca.data_source) as `datasets`' own loaders read it: data files as they are, a
save_to_disk directory, a hub dataset; a file that cannot be read is one line naming it."""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import json
import os
import re
from pathlib import Path

import datasets
import fsspec
import pandas

from alpaca.data_source import ACCEPTED, DataSource, data_source, file_loader
from alpaca.errors import UsageError
from alpaca.manifest import cache_root


@contextlib.contextmanager
def datasets_logging_quiet():
    """Silence `datasets`, which logs a loader's failure before raising it: the one line is ours (read_dataset)."""
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)


# A line that is JSON's null alone (after a byte-order mark, between blanks): pyarrow's JSON reader, which datasets'
# json loader runs, crashes the process (a segmentation fault) on a block that starts with one. datasets hands it a
# JSON array as one such line a record, written anew.
NULL_LINE = re.compile(rb"^(?:\xef\xbb\xbf)?[ \t\r]*null[ \t\r]*$", re.MULTILINE)


def null_record(path: str) -> str | None:
    """Return where a (possibly compressed) JSON file holds a null where datasets finds its records, or None: in a
    JSON array (read whole, as datasets reads it) the element's index, "record N"; in JSON Lines the line's number,
    "line N", the file scanned in blocks of whole lines at the disk's pace."""
    with fsspec.open(path, "rb", compression="infer") as file:
        if file.read(len(codecs.BOM_UTF8) + 1).removeprefix(codecs.BOM_UTF8).startswith(b"["):
            file.seek(0)
            records = json.loads(file.read().removeprefix(codecs.BOM_UTF8))
            return next((f"record {index}" for index, record in enumerate(records) if record is None), None)
        file.seek(0)
        lines_before, tail = 0, b""
        while True:
            chunk = file.read(1 << 24)
            block = tail + chunk
            complete = block[: block.rfind(b"\n") + 1] if chunk else block
            match = NULL_LINE.search(complete)
            if match:
                line = lines_before + complete.count(b"\n", 0, match.start()) + 1
                return f"line {line}"
            if not chunk:
                return None
            lines_before, tail = lines_before + complete.count(b"\n"), block[len(complete) :]


def as_itself(path: str) -> str:
    """Return a name under which datasets reads `path` as itself: `path`, or where it holds a colon (fsspec's
    protocol, `::` its URL chaining), a link to it named without one, in this user's cache
    (alpaca.manifest.cache_root) under a hash of the path: the same for every process of a run, made atomically."""
    if ":" not in path:
        return path
    target = os.path.abspath(path)
    link = Path(cache_root(), "links", hashlib.sha256(target.encode()).hexdigest()[:16],
                os.path.basename(target).replace(":", "_"))
    if not (link.is_symlink() and os.readlink(link) == target):
        link.parent.mkdir(parents=True, exist_ok=True)
        staging = link.with_name(f".{link.name}.{os.getpid()}")
        staging.unlink(missing_ok=True)
        staging.symlink_to(target)
        staging.replace(link)
    return str(link)


def directory_files(flag: str, path: str) -> tuple[DataSource, dict[str, list[str]]]:
    """Find the data files of a local directory by split, as datasets' load_dataset(directory) finds them (its split
    names: train, test, ...), for a directory whose name datasets would misread (glob characters, a colon)."""
    base = glob.escape(as_itself(path))
    try:
        patterns = datasets.data_files.get_data_patterns(base)
    except datasets.data_files.EmptyDatasetError:
        raise UsageError(f"{flag} {path!r} holds no data files; pass {ACCEPTED}") from None
    splits = {str(split): list(files)
              for split, files in datasets.data_files.DataFilesDict.from_patterns(patterns, base_path=base).items()}
    files = tuple(file for split in splits.values() for file in split)
    loaders = {file_loader(flag, file) for file in files}
    if len(loaders) > 1:
        raise UsageError(f"{flag} {path!r} holds files of several kinds ({', '.join(sorted(loaders))}); pass files "
                         "of one kind")
    return DataSource("files", path, loaders.pop(), files), splits


def load_files(source: DataSource, flag: str, splits: dict[str, list[str]] | None = None) -> datasets.DatasetDict:
    """Load data files, as they are, through `datasets`' packaged loader: every file as the split 'train', or the files
    of each of `splits`. A CSV's cells are read as the text they are ("007" stays "007", an empty cell ""), as in a
    JSON file of strings. A JSON file with a null where datasets finds its records is refused (null_record)."""
    splits = splits or {"train": list(source.files)}
    for file in source.files if source.loader == "json" else ():
        where = null_record(as_itself(file))
        if where is not None:
            raise UsageError(f"{flag} {source.path!r}: {where} of {file} is null, not a record (a JSON object); "
                             "remove it, or write the record there")
    # datasets reads each of data_files as a pattern: escaped, a file named data[1].json is that file
    data_files = {split: [glob.escape(as_itself(file)) for file in files] for split, files in splits.items()}
    if source.loader != "csv":
        return datasets.load_dataset(source.loader, data_files=data_files)
    # The columns as datasets' csv loader (pandas.read_csv) names them: after a byte-order mark, inside a .csv.gz,
    # an unnamed index column written by pandas as 'Unnamed: 0'.
    columns = pandas.read_csv(as_itself(source.files[0]), nrows=0).columns
    return datasets.load_dataset("csv", data_files=data_files, keep_default_na=False,
                                 features=datasets.Features({column: datasets.Value("string") for column in columns}))


def read_dataset(path: str, flag: str, split: str | None = "train", config: str | None = None,
                 split_flag: str = "--data_split") -> datasets.Dataset:
    """Read the records at `path` (alpaca.data_source) as `datasets`' own loaders read them: data files, a
    save_to_disk Dataset or DatasetDict, a local directory of data files or a hub dataset (`config`); of several
    splits, `split` (None: the only one)."""
    source = data_source(flag, path)
    where = f"{flag} {path!r}"
    no_records = UsageError(f"{where} holds no records; pass {ACCEPTED} with at least one example")
    try:
        with datasets_logging_quiet():
            if source.kind == "saved":
                loaded = datasets.load_from_disk(path)
            elif source.kind == "files":
                loaded = load_files(source, flag)
            elif source.kind == "directory" and (glob.has_magic(path) or ":" in path):
                files, splits = directory_files(flag, path)
                loaded = load_files(files, flag, splits)
            else:
                loaded = datasets.load_dataset(path, config)
    except UsageError:
        raise
    except StopIteration:  # datasets' json loader, on files without a line (it takes the columns from the first)
        raise no_records from None
    except (datasets.exceptions.DatasetsError, ValueError, OSError, UnicodeDecodeError) as error:
        reason = str(error.__cause__ or error).strip().splitlines()[0]
        if "corresponds to no data" in reason:  # what the packaged loaders say of files without a record
            raise no_records from None
        raise UsageError(f"cannot read {where}: {reason}") from None
    if isinstance(loaded, datasets.Dataset):
        if split not in (None, "train", loaded.split):  # "train": --data_split's default
            raise UsageError(f"{where} is one save_to_disk Dataset, not a DatasetDict: it has no split {split!r}; "
                             f"drop {split_flag}")
        return loaded
    if split is None and len(loaded) == 1:
        return next(iter(loaded.values()))
    if split not in loaded:
        raise UsageError(f"{where} has {'no split' if split else 'several splits'}{f' {split!r}' if split else ''}: "
                         f"its splits are {', '.join(map(repr, loaded))}; pick one with {split_flag}")
    return loaded[split]
