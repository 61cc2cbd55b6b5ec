"""Tidal: online RL of LLMs from production traffic."""
