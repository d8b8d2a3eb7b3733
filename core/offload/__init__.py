"""Offloaded inference: weights streamed layer by layer from host memory or disk."""
