"""Read a data source (alpaca.data_source) as `datasets`' own loaders read it: data files as they are, a
save_to_disk directory, a hub dataset; a file that cannot be read is one line naming it."""

from __future__ import annotations

import contextlib
import glob

import datasets
import pandas

from alpaca.data_source import ACCEPTED, DataSource, data_source
from alpaca.errors import UsageError


@contextlib.contextmanager
def datasets_logging_quiet():
    """Silence `datasets`, which logs a loader's failure before raising it: the one line is ours (read_dataset)."""
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_files(source: DataSource) -> datasets.DatasetDict:
    """Load data files, as they are, through `datasets`' packaged loader. A CSV's cells are read as the text they are
    ("007" stays "007", an empty cell ""), as in a JSON file of strings."""
    # datasets reads each of data_files as a pattern: escaped, a file named data[1].json is that file
    files = [glob.escape(file) for file in source.files]
    if source.loader != "csv":
        return datasets.load_dataset(source.loader, data_files=files)
    # The columns as datasets' csv loader (pandas.read_csv) names them: after a byte-order mark, inside a .csv.gz,
    # an unnamed index column written by pandas as 'Unnamed: 0'.
    columns = pandas.read_csv(source.files[0], nrows=0).columns
    return datasets.load_dataset("csv", data_files=files, keep_default_na=False,
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
                loaded = load_files(source)
            else:
                loaded = datasets.load_dataset(path, config)
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
