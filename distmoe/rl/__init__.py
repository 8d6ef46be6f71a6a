"""Local RL stage (GRPO-style policy optimisation with train/inference mismatch correction).

Owns: the RL building blocks (losses, advantages). Must not: import flwr or talk to the wire.
"""
