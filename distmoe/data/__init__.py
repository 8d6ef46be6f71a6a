"""Party data: instruction-tuning files (Alpaca or chat JSONL), their validation, the deterministic
train/held-out split, chat-template encoding with prompt masking, and the synthetic demo tasks.

Nothing in this package reads another party's data or sends anything anywhere.
"""
