"""The trainer-side client API: any Python training loop under rolledger's control plane.

    from rolledger.client import TrainerClient, policy_weights, token_logprobs

    with TrainerClient.connect("redis://127.0.0.1:6379/0", "my-run") as client:
        model = ...  # the run's policy: client.model_dir is its Hugging Face checkpoint
        restored = client.restore()  # a restarted loop continues from the weights the log says it holds
        ...
        while (batch := client.next_batch(policy_weights(model))) is not None:
            client.agreement(batch, token_logprobs(model, batch.on_policy_trajectories))
            stats = my_step(model, batch.trajectories, batch.rewards)  # loss, reward_mean, max_seq_ratio, ...
            client.publish(batch, policy_weights(model), stats)  # the published version, or UpdateFailed
        client.serve_until_finished()

`rolledger run --trainer external` starts everything but the trainer and waits for such a loop to connect;
`examples/torch_trainer.py` is one, run by the tests. The implementation is `rolledger.workers.roles.trainer_client`
(the client) and `rolledger.workers.roles.trainer_api` (its values and errors); this module re-exports them as the
public API.
"""

from rolledger.workers.policy.policy_model import policy_state as policy_weights
from rolledger.workers.roles.trainer import token_logprobs
from rolledger.workers.roles.trainer_api import (
    Agreement,
    Batch,
    ClientError,
    LineageError,
    Restored,
    RunOver,
    StepRefused,
    StepStats,
    UpdateFailed,
    check_lineage,
    gap_stats,
)
from rolledger.workers.roles.trainer_client import TrainerClient
from rolledger.workers.weights.tensors import state_digest as weights_digest

__all__ = [
    "Agreement",
    "Batch",
    "ClientError",
    "LineageError",
    "Restored",
    "RunOver",
    "StepRefused",
    "StepStats",
    "TrainerClient",
    "UpdateFailed",
    "check_lineage",
    "gap_stats",
    "policy_weights",
    "token_logprobs",
    "weights_digest",
]
