"""Local RL stage (GRPO-style policy optimisation with train/inference mismatch correction) and local DPO
(preference optimisation, ``dpo.py``, which shares the inference engines and the IcePop mask).

Owns: the RL building blocks (losses, advantages). Must not: import flwr or talk to the wire.
"""
