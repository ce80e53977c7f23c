"""What every process of a run shares: the role loop over the log (`runtime`), one tail of the log shared by the roles
of a process (`shared_tail`), how a serving process uses the garbage collector (`gc_policy`), and which addresses
rolledger drives or serves (`netguard`).

May import: rolledger.schemas, rolledger.events, rolledger.workflows. No other workers/ sub-package.
"""
