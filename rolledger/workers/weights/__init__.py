"""The weight path of an update transaction: checksums and digests of live tensors (`tensors`), the staging store
(its on-disk format, checksums and loader), the transports that move a version to every rank (`transport`: the
directory transport; `transport_dist`: torch.distributed and its protocol, with the trainer's side in
`transport_dist_server`, a rank's in `transport_dist_receive` and the delta encoding in `transport_dist_delta`), and
vLLM's side of it (`vllm_extension`, the worker extension; `vllm_transfer_engine`, the weight-transfer engine
plug-in).

May import: rolledger.schemas, rolledger.events, rolledger.workflows, workers.runtime, workers.policy.
"""
