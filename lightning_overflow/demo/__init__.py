"""The demo behind ``python -m lightning_overflow demo``: a byte-level transformer that diverges bare."""
