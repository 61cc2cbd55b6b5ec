"""Seeded simulators that drive Tidal's decision code fast, without servers."""
