"""The distmoe ClientApp (thin: decode, call the library, encode) and the data owner's pinned launcher of it."""
