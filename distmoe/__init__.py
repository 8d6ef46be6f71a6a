"""distmoe: privacy-preserving federated instruction tuning of Mixture-of-Experts models on Flower.

The library (everything under ``distmoe/``) is importable and testable without a Flower run; the
thin Flower apps live in ``server/`` and ``clients/``.
"""

__version__ = "0.1.0"
