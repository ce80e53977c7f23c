"""The policy and what it learns from: the torch policy model and its Hugging Face checkpoints, the GRPO loss, the
sampling distribution shared by engine and trainer, the tasks and reward functions (built in, or plug-ins given by
import path), and the run's inputs checked before anything heavy is imported (`run_inputs`).

May import: rolledger.schemas, rolledger.events, rolledger.workflows, workers.runtime.
"""
