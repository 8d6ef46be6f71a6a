"""Router statistics, the global router anchor, anchor-KL and aux losses, routing metrics."""
