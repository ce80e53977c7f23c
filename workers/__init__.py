"""Stateless processes and the engines they drive: rollout, reward, trainer, rank agent, vLLM extension."""
