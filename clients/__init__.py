"""The distmoe ClientApp (thin: decode, call the library, encode)."""
