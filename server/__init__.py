"""The distmoe ServerApp (thin: a Grid transport around ``distmoe.coordinator``)."""
