"""Pydantic v2 models: the event envelope and every event payload, the trajectory, the weight manifest, the run config."""
