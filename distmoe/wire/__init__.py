"""The outbound boundary: the closed payload schema and the codec, the only place where Flower
records are built and read (so the only place bytes leave or enter a process)."""
