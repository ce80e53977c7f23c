"""The interpreters that do I/O: every process of a run, the engines they drive, the weight path and the operator's
commands. Decisions are not made here (they are pure functions in `rolledger.workflows`); a worker reads the log,
asks its decider, and carries out the commands.

Sub-packages, each importing only those listed before it (tests/test_layering.py enforces the direction):

- `runtime/`  what every process shares: the log-reading loop and its shared tail, the garbage-collector policy,
  the network guard for addresses rolledger drives or serves.
- `policy/`   the model and what it learns from: the policy model, GRPO, sampling, tasks and rewards (plug-ins),
  Hugging Face checkpoints, the run's inputs checked before anything heavy is imported.
- `weights/`  the weight path: tensor checksums, the staging store and its format, the directory and torch.distributed
  transports, vLLM's weight-transfer engine.
- `engines/`  one inference rank each: the Engine protocol and the torch, simulated, vLLM and SGLang engines.
- `roles/`    the run's roles: coordinator, rank (and its rollout loop), reward, trainer and the trainer client API.
- `operator/` what an operator runs and looks at: the CLI, `rolledger run` on one machine and the distributed
  processes, the live display, `rolledger ui`, the timeline drawing, metrics, the incident log, fault injection.
"""
