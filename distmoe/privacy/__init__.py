"""The privacy plane: DP mechanisms and integer encoding (``dp``), privacy accounting
(``accountant``) and secure aggregation. Never imports ``flwr``."""
