"""rolledger: an auditable, event-sourced control plane for asynchronous RL rollouts.

The design card's folders install as one namespace: `rolledger.schemas` (pydantic models, no torch, no clock),
`rolledger.events` (the log on Redis Streams), `rolledger.workflows` (pure functions: the reducer and every decider),
`rolledger.workers` (interpreters that do I/O, engines, and the CLI wiring). In the source tree they stay at the top
level; `rolledger/` links to them so that tools (mypy, pytest, an editable install) see the installed names.
"""

__version__ = "0.1.0"
