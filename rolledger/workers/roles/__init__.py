"""The roles of a run, each a thin interpreter of its decider in `rolledger.workflows`: the coordinator, the rank
agent and its rollout loop, the reward worker, the built-in trainer and the trainer-side client API any training loop
uses (public as `rolledger.client`).

May import: rolledger.schemas, rolledger.events, rolledger.workflows, workers.runtime, workers.policy,
workers.weights, workers.engines.
"""
