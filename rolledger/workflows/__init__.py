"""Pure state machines (the reducer), coordinators that decide from state, replay, audit, lineage, and the CLI."""
