"""The command line's exit codes (`EXIT_CODES`, printed in every command's help) and `CliError`, the refused input
that `main` prints as one line and exits 2 for. Light: every command module imports it.
"""

from __future__ import annotations

from rolledger.workers.policy.run_inputs import RUNS_DIR_HELP

EXIT_OK = 0
EXIT_VIOLATED = 1  # audit/replay: an invariant is violated (or a log entry does not decode)
EXIT_USAGE = 2  # a bad option, config, run id or injection; a run or trajectory that does not exist
EXIT_RUN_FAILED = 3  # the run ended failed or aborted, Redis stayed away past its deadline or refused us

EXIT_CODES = f"""exit codes:
  {EXIT_OK}       ok
  {EXIT_VIOLATED}       an invariant is violated (audit, replay: the violating events are listed)
  {EXIT_USAGE}       a usage or input error: a bad option, config, run id or --inject; a run or trajectory that
          does not exist
  {EXIT_RUN_FAILED}       the run ended failed or aborted, a worker process stopped on an error, Redis stayed
          away past ROLLEDGER_REDIS_DEADLINE_S (60 s), or it refused the credentials, the ACL user (NOPERM)
          or the TLS handshake (at once, not retried)
  128+N   `rolledger run` cancelled by signal N (130: SIGINT, 143: SIGTERM)

runs: RUN is a run directory, or a run id looked up in the runs directory
({RUNS_DIR_HELP}); with --redis URL (or REDIS_URL) the id is looked up in that Redis."""


class CliError(Exception):
    """A refused input or a run that does not exist: `main` prints the message as one line and exits 2."""
