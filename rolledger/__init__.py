"""rolledger: an auditable, event-sourced control plane for asynchronous RL rollouts.

One namespace, one tree: `rolledger.schemas` (the log's records and the run config: no torch, no clock),
`rolledger.events` (the log on Redis Streams), `rolledger.workflows` (pure functions: the reducer and every decider),
`rolledger.workers` (interpreters that do I/O: runtime, policy, weights, engines, roles, operator) and
`rolledger.client` (the public trainer API). The files live at their import paths under rolledger/; the design card's
top-level folders (events/, schemas/, workers/, workflows/) are links into it.
"""

__version__ = "0.1.0"
