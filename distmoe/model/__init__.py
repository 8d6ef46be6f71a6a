"""Model construction (tiny default Qwen3-MoE or a local checkpoint), tokenizer, router capture,
and the selection of which parameters are trained and sent."""
