"""Installed into every process the chaos harness starts (PYTHONPATH=tests/chaos/hook): loads the chaos hook when
the harness asked for it (ROLLEDGER_ACK_LOG or ROLLEDGER_CHAOS_ARM_DIR set); does nothing otherwise.

A sitecustomize that raises is only warned about by Python, so the hook proves it is installed by writing a header
line to its ack log; the harness treats a missing header as a broken harness, never as "no events acknowledged"."""

import os

if os.environ.get("ROLLEDGER_ACK_LOG") or os.environ.get("ROLLEDGER_CHAOS_ARM_DIR"):
    import rolledger_chaos_hook  # type: ignore[import-not-found]  # this folder, on PYTHONPATH in the processes

    rolledger_chaos_hook.install()
