"""One inference rank each: the Engine protocol every engine implements (`protocol`, one contract suite in
tests/engine_contract.py), the built-in torch engine (its batch, decode, prefix cache, memory and weights modules),
the simulated engine of the benches, the vLLM and SGLang engines over their HTTP servers (and the processes that start
those servers), and the factory that builds the engine a run's config names.

May import: rolledger.schemas, rolledger.events, rolledger.workflows, workers.runtime, workers.policy,
workers.weights.
"""
