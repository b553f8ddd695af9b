"""Where records come from, told from --data_path alone: data files (a file or a glob of them) and the `datasets`
loader that reads them, a directory written by `datasets`' save_to_disk, another local directory, or a hub name;
and the checks of the data flags that read no data. Standard library only: the scripts check the path before torch
and `datasets` are imported."""

from __future__ import annotations

import argparse
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


def check_data_path(flag: str, path: str, config: str | None) -> None:
    """Check that `path` is data files, a directory or a hub name (data_source); --data_config only where there are
    configurations to choose from."""
    source = data_source(flag, path)
    if config is not None and source.kind in ("files", "saved"):
        raise UsageError(f"--data_config {config!r} names a configuration of a hub dataset; {flag} {path!r} is "
                         f"{'data files' if source.kind == 'files' else 'a save_to_disk directory'}, drop it")


def validate_eval(args: argparse.Namespace) -> None:
    """Check that evaluation data comes from a file or a held-out split; the strategy defaults to once per epoch."""
    if args.eval_data_path and args.eval_split_ratio is not None:
        raise UsageError("--eval_data_path and --eval_split_ratio are exclusive; pass one")
    if args.eval_data_path:
        check_data_path("--eval_data_path", args.eval_data_path, None)
    elif args.eval_data_split is not None:
        raise UsageError(f"--eval_data_split {args.eval_data_split!r} picks a split of --eval_data_path; pass "
                         "--eval_data_path, or drop it")
    has_eval_data = bool(args.eval_data_path) or args.eval_split_ratio is not None
    if args.eval_strategy is None:
        args.eval_strategy = "epoch" if has_eval_data else "no"
    if args.eval_strategy != "no" and not has_eval_data:
        raise UsageError(f"--eval_strategy {args.eval_strategy} needs evaluation data; pass --eval_data_path FILE "
                         "or --eval_split_ratio 0.05")
