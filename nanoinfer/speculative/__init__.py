"""Speculative decoding (vLLM's `speculative_config`): proposers guess the next k tokens of a
decoding sequence, one target step scores all k + 1 positions, and the engine keeps the longest
prefix the target agrees with plus one token of its own (see README, "Speculative decoding"). The
engine reaches it through one row planner (row_planner.py), chosen by nanoinfer/features.py."""
