"""The kinds of failure a user sees as one line and an exit status, never as a traceback."""


class UsageError(ValueError):
    """A user mistake: reported as one line and a non-zero exit, never as a traceback."""

    exit_code = 2
    found_by_every_rank = True  # rank 0 reports it; the others wait for the launcher to stop them


class JoinTimeout(UsageError):
    """A rank that waited --ddp_timeout for the others to start the process group: each rank that waited says so,
    with exit status 1."""

    exit_code = 1
    found_by_every_rank = False


class StorageError(UsageError):
    """A write that failed for a reason outside the program (disk full, quota, permissions): reported the same
    way, with exit status 1 (it is not a mistake on the command line)."""

    exit_code = 1


class PlannedFailure(UsageError):
    """What the code would do wrong on GPUs, found by --plan on fake ones (alpaca.plan): reported the same way, with
    exit status 1 (the command line is not at fault)."""

    exit_code = 1
