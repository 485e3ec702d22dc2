"""What a user is told when fived refuses or stops: the errors every layer raises and the one line
each becomes. Plain Python (no torch), so that `fived plan`, `fived config` and the API's checks
report a bad value without loading the runtime."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot run. Its message is one line: field, value, rule, alternative."""

    def __init__(self, field_name: str, value: Any, rule: str, hint: str = ""):
        self.field, self.value, self.rule, self.hint = field_name, value, rule, hint
        msg = f"{field_name}={value}: {rule}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


NOT_GIVEN = "(not given)"  # the value a ConfigError names for a required flag that was left out


class Stopped(RuntimeError):
    """The launcher was told to stop (SIGINT, or SIGTERM); `signal_name` says which, `results` holds
    what ranks that finished their stop (a preemption save) returned."""

    def __init__(self, signal_name: str, results: list | None = None, abandoned_save: bool = False):
        super().__init__(signal_name)
        self.signal_name, self.results = signal_name, results
        self.abandoned_save = abandoned_save  # a second signal cut the preemption save short


def user_error(error: BaseException) -> tuple[int, str] | None:
    """(exit code, the one line for stderr) of an error the user caused or asked for; None for a bug
    (which keeps its traceback)."""
    if isinstance(error, ConfigError):
        return 2, f"fived: error: {error}"
    if isinstance(error, OSError):  # a write or read the machine refused (full disk, read-only, permissions)
        from fived.write_errors import describe

        return 1, f"fived: error: {describe(error)}"
    if isinstance(error, KeyboardInterrupt):  # (before or after the ranks; while they run, the launcher handles it)
        return 130, "fived: interrupted"
    if isinstance(error, Stopped):  # a signal while `fived verify` ran its ranks
        return (
            130 if error.signal_name == "SIGINT" else 143
        ), f"\nfived: stopped by {error.signal_name}; every rank was stopped"
    return None
