"""Decisions per round and per call: K and the draft's shape, graphs, the round's costs and its timers."""
