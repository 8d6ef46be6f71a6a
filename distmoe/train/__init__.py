"""Local training at a party: the SFT loop with its stability guards, optimizer groups, and the
local evaluation used by the eval phase."""
