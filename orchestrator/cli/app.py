"""spotctl: the typer app. Each verb group lives in orchestrator/cli/<group>.py and exposes
`register(app)`; this module wires them and turns errors into one line + exit 2."""

from __future__ import annotations

import importlib
import sys

import typer

from orchestrator.common.errors import UserError

app = typer.Typer(
    name="spotctl",
    help="Serve LLMs on spot GPUs across clouds without noticing preemptions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _global(
    log_level: str = typer.Option(None, "--log-level", metavar="LEVEL",
                                  help="debug|info|warning|error of the daemon this starts "
                                       "(or $SPOT_ORCHESTRATOR_LOG_LEVEL)."),
) -> None:
    """Serve LLMs on spot GPUs across clouds without noticing preemptions."""
    import os

    from orchestrator.common import logsetup

    if log_level is not None:  # the daemon (`spotctl daemon`, or started by `up`) reads it
        os.environ[logsetup.LEVEL_ENV] = logsetup.level_name(log_level)


# One line per verb group; a group's module owns its commands.
COMMAND_MODULES = [
    "service",
    "cost",
    "prices",
    "simulate",
    "db",
]

for _name in COMMAND_MODULES:
    importlib.import_module(f"orchestrator.cli.{_name}").register(app)


def main() -> None:
    try:
        app(standalone_mode=False, prog_name="spotctl")
    except UserError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(err.exit_code)
    except typer.Exit as err:
        sys.exit(err.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:  # usage errors and anything unforeseen: one line, no traceback
        if hasattr(err, "format_message") and hasattr(err, "exit_code"):  # (typer's vendored) click errors
            ctx = getattr(err, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            typer.echo(f"error: {err.format_message()}{hint}", err=True)
            sys.exit(err.exit_code)
        typer.echo(f"error: {type(err).__name__}: {err}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
